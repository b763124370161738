#!/usr/bin/env bash
# Installs every CUDA toolkit leg listed in wheels.toml (nvcc, cudart, cuobjdump) inside the
# manylinux_2_28 (AlmaLinux 8) container that cibuildwheel builds in. Run as cibuildwheel's before-all.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3 || echo /opt/python/cp312-cp312/bin/python)
dnf install -y dnf-plugins-core
dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
"$py" "$here/matrix.py" toolkits | while read -r name cuda full; do
  v=${cuda/./-}
  echo "installing CUDA $full for the $name leg"
  dnf install -y "cuda-nvcc-$v" "cuda-cudart-devel-$v" "cuda-cuobjdump-$v"
  test -x "/usr/local/cuda-$cuda/bin/nvcc"
done
