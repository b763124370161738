"""`wllm doctor`: what this machine has, what wLLM can use, and the one-line fix for what is missing."""

from __future__ import annotations

import ctypes
import json
import platform
import sys
from dataclasses import asdict, dataclass, field

from wllm.version import __version__


@dataclass
class Check:
    name: str
    value: str
    ok: bool = True
    fix: str | None = None


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, value: str, ok: bool = True, fix: str | None = None) -> None:
        self.checks.append(Check(name, value, ok, fix))

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def driver_version() -> str | None:
    """The NVIDIA driver's CUDA version via the driver library itself (no toolkit needed)."""
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    return None


def collect() -> Report:
    report = Report()
    report.add("wllm", __version__)
    report.add("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.platform}, "
                         f"{platform.machine()})")
    try:
        import torch
    except ImportError:
        report.add("torch", "not installed", ok=False, fix="pip install torch")
        return report
    report.add("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    driver = driver_version()
    report.add("nvidia driver", f"supports CUDA {driver}" if driver else "not found")

    from wllm.kernels import _lib

    info = _lib.build_info()
    lib_path = _lib.library_path()
    if lib_path.is_file() and info:
        legs = "; ".join(
            f"{leg['name']} (nvcc {leg['nvcc']}): SM {', '.join(leg['sm'])}"
            + (f" + PTX {leg['ptx']}" if leg["ptx"] else "")
            for leg in info["legs"]
        )
        missing = info.get("missing_sm") or {}
        not_built = f"; not built: SM {', '.join(missing)}" if missing else ""
        report.add("kernel library", f"{lib_path} [{legs}]{not_built}")
    elif lib_path.is_file():
        report.add("kernel library", f"{lib_path} (no build_info.json)")
    else:
        report.add("kernel library", "not installed (CPU-only package)")

    if not torch.cuda.is_available():
        if driver and not torch.version.cuda:
            report.add("gpu", "an NVIDIA driver is present but this PyTorch is a CPU-only build", ok=False,
                       fix="pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu128")
        elif driver:
            report.add("gpu", "driver found but PyTorch sees no CUDA device", ok=False,
                       fix="check `nvidia-smi`; the driver must support PyTorch's CUDA " + str(torch.version.cuda))
        else:
            report.add("gpu", "none: wLLM runs on the CPU (slow, fine for small models and tests)")
        return report

    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        report.add(f"gpu {index}", f"{props.name}, SM {props.major}.{props.minor}, "
                                   f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
        try:
            binding = _lib.binding(index)
        except _lib.KernelLibraryError as exc:
            report.add(f"kernels on gpu {index}", str(exc), ok=False,
                       fix="pip install --force-reinstall wllm-server  (a prebuilt wheel with kernels for your GPU)")
            continue
        leg_sms = next((leg["sm"] for leg in (info or {}).get("legs", []) if leg["name"] == binding.leg), [])
        if f"{props.major}.{props.minor}" in leg_sms:
            how = f"prebuilt SASS for sm_{binding.binary_sm}"
        else:
            how = "no prebuilt SASS for this SM: PTX JIT-compiled by the driver (slower first start)"
        report.add(f"kernels on gpu {index}", f"loaded ({binding.leg} leg, {how})")
    return report


def run(as_json: bool = False) -> int:
    """Print the report; exit status 1 when something a user needs is missing."""
    report = collect()
    if as_json:
        print(json.dumps({"ok": report.ok, "checks": [asdict(c) for c in report.checks]}, indent=2))
        return 0 if report.ok else 1
    width = max(len(c.name) for c in report.checks)
    for check in report.checks:
        mark = "ok " if check.ok else "ERR"
        print(f"[{mark}] {check.name:<{width}}  {check.value}")
        if check.fix:
            print(f"      {'':<{width}}  fix: {check.fix}")
    print("all good" if report.ok else "problems found (see fix lines above)")
    return 0 if report.ok else 1
