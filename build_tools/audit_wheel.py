"""Audits a built wheel: lists the SASS and PTX in its kernel library and fails if any SM that
wheels.toml promises is missing.

    python build_tools/audit_wheel.py dist/wllm_server-*.whl [--toolkits cuda13]

`--toolkits` limits the promise to the toolkit legs built on this machine (e.g. CI machines that
only have CUDA 13 cannot build the CUDA 12.x leg for SM 7.0); the release workflow audits all legs.
cuobjdump is taken from --cuobjdump, PATH, CUDA_HOME/bin or the `nvidia-cuda-cuobjdump` package.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_build import load_matrix, sm_code  # noqa: E402

EXE = ".exe" if os.name == "nt" else ""


def find_cuobjdump(explicit: str | None = None) -> Path | None:
    if explicit:
        return Path(explicit)
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / f"cuobjdump{EXE}").is_file():
            return Path(home) / "bin" / f"cuobjdump{EXE}"
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for candidate in Path(base).glob(f"*/bin/cuobjdump{EXE}"):
            return candidate
    return None


def kernels_by_sm(cuobjdump: Path, library: Path) -> dict[str, set[str]]:
    """SM ('90') -> names of the wLLM kernels with SASS for it (cudart's own kernels are ignored)."""
    out = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(library)], capture_output=True,
                         text=True, check=True).stdout
    result: dict[str, set[str]] = {}
    arch = None
    for line in out.splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = m.group(1)
            result.setdefault(arch, set())
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m and arch and "wllm" in m.group(1):
            result[arch].add(m.group(1))
    return {sm: names for sm, names in result.items() if names}


def ptx_archs(cuobjdump: Path, library: Path) -> set[str]:
    proc = subprocess.run([str(cuobjdump), "--list-ptx", str(library)], capture_output=True, text=True)
    return set(re.findall(r"\.sm_(\d+)\.ptx", proc.stdout))


def load_problem(library: Path) -> str | None:
    """Why the library cannot be loaded (e.g. a symbol no object defines: the linker leaves it for the
    loader, and ctypes binds every symbol at load), or None. Needs no GPU: cudart is linked statically
    and finds the driver only when first called."""
    try:
        ctypes.CDLL(str(library))
    except OSError as e:
        return str(e)
    return None


def audit(wheel: Path, toolkits: list[str] | None, cuobjdump: Path) -> list[str]:
    """Returns the list of problems (empty when the wheel keeps every promise)."""
    matrix = load_matrix()
    legs = [t for t in matrix.toolkits if toolkits is None or t.name in toolkits]
    unknown = set(toolkits or []) - {t.name for t in matrix.toolkits}
    if unknown:
        return [f"unknown toolkit legs {sorted(unknown)}; wheels.toml has {[t.name for t in matrix.toolkits]}"]
    problems = []
    name = wheel.name
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        libs = [n for n in zf.namelist() if re.fullmatch(r"wllm/_lib/(lib)?wllm_kernels\.(so|dll)", n)]
        if not libs:
            return [f"{name}: no kernel library inside (a CPU-only wheel)"]
        if "-py3-none-" not in name or name.endswith("-any.whl"):
            problems.append(f"{name}: a wheel with the kernel library must be tagged py3-none-<platform>")
        library = Path(zf.extract(libs[0], tmp))
        info = json.loads(zf.read("wllm/_lib/build_info.json")) if "wllm/_lib/build_info.json" in zf.namelist() else {}
        found = kernels_by_sm(cuobjdump, library)
        ptx = ptx_archs(cuobjdump, library)
        unresolved = load_problem(library)
        if unresolved:
            problems.append(f"{name}: the kernel library does not load: {unresolved}")
    all_kernels = set().union(*found.values()) if found else set()
    print(f"{name}: kernel library {libs[0]}")
    for leg in legs:
        # A leg's kernels live in its own namespace: 'wllm' for the primary, 'wllm__<name>' otherwise.
        if leg.primary:
            expected = {k for k in all_kernels if "wllm__" not in k}
        else:
            expected = {k for k in all_kernels if f"wllm__{leg.name}" in k}
        for sm in leg.sm:
            code = sm_code(sm)
            have = {k for k in found.get(code, set()) if k in expected}
            status = "ok" if expected and have == expected else "MISSING"
            print(f"  SM {sm:>5} [{leg.name}]  SASS for {len(have)}/{len(expected)} kernels  {status}")
            if status != "ok":
                problems.append(f"SM {sm} ({leg.name} leg): SASS for {len(have)} of {len(expected)} kernels")
        if leg.ptx:
            code = sm_code(matrix.ptx)
            ok = code in ptx
            print(f"  PTX {matrix.ptx:>4} [{leg.name}]  {'ok' if ok else 'MISSING'}")
            if not ok:
                problems.append(f"PTX for compute_{code} missing")
    extra = sorted(set(found) - {sm_code(s) for t in matrix.toolkits for s in t.sm})
    if extra:
        print(f"  note: SASS also present for sm_{', sm_'.join(extra)} (not promised by wheels.toml)")
    skipped = [t.name for t in matrix.toolkits if t not in legs]
    if skipped:
        sms = ", ".join(s for t in matrix.toolkits if t not in legs for s in t.sm)
        print(f"  not audited here: legs {skipped} (SM {sms})")
    if info.get("build_seconds") is not None:
        print(f"  build: {info.get('objects_compiled')} objects compiled, {info.get('objects_from_cache')} from cache, "
              f"{info['build_seconds']} s")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description="Check that a wllm wheel carries code for every promised SM.")
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--toolkits", default=None,
                        help="comma-separated toolkit legs to audit (default: all legs in wheels.toml)")
    parser.add_argument("--cuobjdump", default=None)
    args = parser.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    if cuobjdump is None:
        print("error: cuobjdump not found; install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`",
              file=sys.stderr)
        return 2
    toolkits = args.toolkits.split(",") if args.toolkits else None
    failed = False
    for wheel in args.wheels:
        problems = audit(wheel, toolkits, cuobjdump)
        for problem in problems:
            print(f"FAIL {wheel.name}: {problem}", file=sys.stderr)
        failed |= bool(problems)
    print("audit failed" if failed else "audit passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
