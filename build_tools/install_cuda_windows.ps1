# Installs every CUDA toolkit leg listed in wheels.toml with NVIDIA's network installer (only the
# compiler, cudart and cuobjdump components) and exports WLLM_CUDA_HOME_<NAME> for later steps.
$ErrorActionPreference = "Stop"
$toolkits = python build_tools/matrix.py toolkits
foreach ($line in $toolkits) {
    $name, $cuda, $full = $line.Split(" ")
    $installer = Join-Path $env:RUNNER_TEMP "cuda_$name.exe"
    $url = "https://developer.download.nvidia.com/compute/cuda/$full/network_installers/cuda_${full}_windows_network.exe"
    Write-Host "installing CUDA $full for the $name leg from $url"
    Invoke-WebRequest -Uri $url -OutFile $installer
    $components = @("nvcc_$cuda", "cudart_$cuda", "cuobjdump_$cuda", "crt_$cuda", "nvvm_$cuda")
    $proc = Start-Process -FilePath $installer -ArgumentList (@("-s") + $components) -Wait -PassThru
    if ($proc.ExitCode -ne 0) { throw "CUDA $full installer exited with $($proc.ExitCode)" }
    $home_dir = "C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v$cuda"
    if (-not (Test-Path "$home_dir\bin\nvcc.exe")) { throw "nvcc.exe missing under $home_dir" }
    "WLLM_CUDA_HOME_$($name.ToUpper())=$home_dir" | Out-File -FilePath $env:GITHUB_ENV -Append -Encoding utf8
}
