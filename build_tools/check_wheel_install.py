"""Proof that the wheel needs no compiler: install it into a fresh virtual environment whose PATH has
no nvcc and no CUDA toolkit, then run `wllm doctor`, `wllm generate` (CPU) and a short `wllm serve`
round trip (with a config file) from it. First the wheel itself is checked: its tags (py3-none-<platform>
with the kernel library, py3-none-any without), exactly one kernel library, no build tree.

    python build_tools/check_wheel_install.py dist/wllm_server-*.whl [--expect-kernels yes|no|auto]
    python build_tools/check_wheel_install.py            # builds the wheel of this tree first

.ci/run calls it on the wheel it has just built and audited (no second kernel build). PyTorch is
installed into the new environment at the version of the running interpreter's (pip's cache or
find-links serve it, so nothing large is downloaded twice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IS_WINDOWS = os.name == "nt"
LIBRARY = re.compile(r"^wllm/_lib/(lib)?wllm_kernels\.(so|dll)$")
# What a wheel must never carry: compiler outputs and the source/build tree.
BUILD_TREE = re.compile(
    r"(^|/)(build|csrc|tests|build_tools|benchmarks|experiments|third_party)/|"
    r"\.(o|obj|lib|exp|ninja|ninja_log|cu|cuh)$|(^|/)build\.ninja$"
)
PLATFORM_TAG = re.compile(r"^(linux_x86_64|manylinux_\d+_\d+_x86_64|manylinux\d*_x86_64|win_amd64)$")


def stamp(message: str) -> None:
    print(f"[wheel-install] {message}", flush=True)


def check_wheel(wheel: Path, expect_kernels: str = "auto") -> list[str]:
    """Problems with the wheel's tags and contents (empty: fine)."""
    problems = []
    match = re.fullmatch(r"wllm_server-[^-]+-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl", wheel.name)
    if not match:
        return [f"{wheel.name}: not a wllm_server wheel file name"]
    names = zipfile.ZipFile(wheel).namelist()
    libraries = [n for n in names if LIBRARY.match(n)]
    has_kernels = bool(libraries)
    if expect_kernels == "yes" and not has_kernels:
        problems.append(f"{wheel.name}: no kernel library inside (wllm/_lib/)")
    if expect_kernels == "no" and has_kernels:
        problems.append(f"{wheel.name}: a kernel library inside, but a CPU-only wheel was expected")
    if len(libraries) > 1:
        problems.append(
            f"{wheel.name}: {len(libraries)} kernel libraries ({', '.join(libraries)}); exactly one expected"
        )
    stray = [
        n
        for n in names
        if n.startswith("wllm/_lib/")
        and not LIBRARY.match(n)
        and n not in ("wllm/_lib/__init__.py", "wllm/_lib/build_info.json")
    ]
    if stray:
        problems.append(f"{wheel.name}: unexpected files in wllm/_lib/: {', '.join(stray)}")
    if has_kernels:
        if (match["py"], match["abi"]) != ("py3", "none") or not PLATFORM_TAG.match(match["plat"]):
            problems.append(f"{wheel.name}: a wheel with the kernel library must be tagged py3-none-<platform>")
        if "wllm/_lib/build_info.json" not in names:
            problems.append(f"{wheel.name}: the kernel library comes without wllm/_lib/build_info.json")
    elif (match["py"], match["abi"], match["plat"]) != ("py3", "none", "any"):
        problems.append(f"{wheel.name}: a CPU-only wheel must be tagged py3-none-any")
    tree = [n for n in names if BUILD_TREE.search(n)]
    if tree:
        problems.append(f"{wheel.name}: carries the build tree: {', '.join(tree[:5])}")
    if "wllm/cli.py" not in names or not any(n.endswith(".dist-info/entry_points.txt") for n in names):
        problems.append(f"{wheel.name}: the package or its `wllm` command is missing")
    return problems


def toolkit_free_env(venv_bin: Path) -> dict[str, str]:
    """The environment of the fresh venv's commands: no nvcc, no CUDA toolkit, nothing from this tree."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "WLLM_CUDA", "NVCC_", "VIRTUAL_ENV", "PYTHON", "CONDA"))
        and k not in ("CUDA_HOME", "CUDA_PATH", "WLLM_KERNEL_LIBRARY", "WLLM_NO_KERNELS", "LD_LIBRARY_PATH")
    }
    nvcc = "nvcc.exe" if IS_WINDOWS else "nvcc"
    kept = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and "cuda" not in d.lower() and not (Path(d) / nvcc).exists()
    ]
    env["PATH"] = os.pathsep.join([str(venv_bin), *kept])
    env["PYTHONUNBUFFERED"] = "1"
    found = shutil.which("nvcc", path=env["PATH"])
    if found:
        raise SystemExit(f"nvcc is still on the PATH for the fresh venv: {found}")
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    stamp(
        f"$ {' '.join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd))}  "
        f"(exit {proc.returncode}, {time.monotonic() - started:.1f} s)"
    )
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return proc


def serve_round_trip(wllm: Path, env: dict[str, str], work: Path) -> None:
    """`wllm serve --config FILE` on the CPU: wait for the ready line, chat once, list models, stop it
    with SIGTERM (CTRL_BREAK on Windows) and expect a clean exit 0."""
    config = work / "serve.toml"
    config.write_text(
        'port = 0\ndevice = "cpu"\nmax-num-seqs = 4\nserved-model-name = ["smoke"]\nshutdown-timeout = 10\n',
        encoding="utf-8",
    )
    flags = subprocess.CREATE_NEW_PROCESS_GROUP if IS_WINDOWS else 0  # type: ignore[attr-defined]
    proc = subprocess.Popen(
        [str(wllm), "serve", "--config", str(config)],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        creationflags=flags,
    )
    started = time.monotonic()
    output: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith("wLLM ready:"):
                break
        else:
            raise SystemExit("wllm serve exited before it was ready:\n" + "".join(output[-40:]))
        base = re.search(r"(http://\S+)/v1", output[-1]).group(1)  # type: ignore[union-attr]
        stamp(f"serve ready at {base} in {time.monotonic() - started:.1f} s")
        body = json.dumps(
            {
                "model": "smoke",
                "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        request = urllib.request.Request(
            f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        text = reply["choices"][0]["message"]["content"]
        if not text or reply["model"] != "smoke":
            raise SystemExit(f"unexpected chat reply: {reply}")
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            models = [m["id"] for m in json.loads(response.read())["data"]]
        stamp(f"chat answered {text!r}; models {models}")
        proc.send_signal(signal.CTRL_BREAK_EVENT if IS_WINDOWS else signal.SIGTERM)  # type: ignore[attr-defined]
        rest, _ = proc.communicate(timeout=60)
        output.append(rest)
        if proc.returncode != 0:
            raise SystemExit(f"wllm serve exited {proc.returncode} after the stop signal:\n" + "".join(output)[-3000:])
        stamp("serve stopped cleanly (exit 0)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def build_wheel(out: Path) -> Path:
    stamp("building the wheel of this tree")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)], check=True)
    return next(out.glob("wllm_server-*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", nargs="?", type=Path, help="the wheel (default: build this tree's)")
    parser.add_argument(
        "--expect-kernels",
        choices=["yes", "no", "auto"],
        default="auto",
        help="whether the wheel must carry the kernel library (auto: either)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="create the venv here and keep it")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wllm-wheel-") as tmp:
        work = Path(tmp)
        wheel = (args.wheel or build_wheel(work / "dist")).resolve()
        problems = check_wheel(wheel, args.expect_kernels)
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        if problems:
            return 1
        kernels = any(LIBRARY.match(n) for n in zipfile.ZipFile(wheel).namelist())
        stamp(f"{wheel.name}: tags and contents ok ({'with' if kernels else 'without'} the kernel library)")

        venv = (args.keep or work / "venv").resolve()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        bin_dir = venv / ("Scripts" if IS_WINDOWS else "bin")
        python = bin_dir / ("python.exe" if IS_WINDOWS else "python")
        env = toolkit_free_env(bin_dir)
        import torch  # the version CI installed; the fresh venv gets the same build

        run([str(python), "-m", "pip", "install", "-q", str(wheel), f"torch=={torch.__version__}"], env, work)
        wllm = bin_dir / ("wllm.exe" if IS_WINDOWS else "wllm")
        where = run([str(python), "-c", "import wllm, os; print(os.path.dirname(wllm.__file__))"], env, work)
        if not Path(where.stdout.strip()).resolve().is_relative_to(venv):
            raise SystemExit(f"wllm imported from {where.stdout.strip()}, not from the fresh venv")
        doctor = run([str(wllm), "doctor"], env, work)
        print(doctor.stdout, end="")
        if kernels and str(venv) not in doctor.stdout:
            raise SystemExit("wllm doctor does not report the wheel's kernel library")
        answer = run(
            [
                str(wllm),
                "generate",
                "What is the capital of France?",
                "--device",
                "cpu",
                "--max-tokens",
                "12",
                "--no-stream",
            ],
            env,
            work,
        )
        if not answer.stdout.strip():
            raise SystemExit("wllm generate printed nothing")
        stamp(f"generate answered {answer.stdout.strip()!r}")
        serve_round_trip(wllm, env, work)
    stamp(f"the wheel works with no compiler and no CUDA toolkit ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
