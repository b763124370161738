"""Builds csrc/*.cu into one C-ABI shared library with nvcc + ninja.

Used by setup.py (`pip install .`) and runnable by hand:
    python build_tools/kernel_build.py --out wllm/_lib [--archs 9.0]

The SM list and toolkit legs come from wheels.toml. `WLLM_CUDA_ARCHS="9.0;8.6"` overrides the
list (primary toolkit only) for quick local builds. Compiled objects are cached under
~/.cache/wllm/build keyed by a hash of the sources, flags and nvcc version, so a rebuild on the same
machine (pip builds in a fresh temporary folder each time) reuses them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
IS_WINDOWS = os.name == "nt"
LIB_NAME = "wllm_kernels.dll" if IS_WINDOWS else "libwllm_kernels.so"


class BuildError(RuntimeError):
    """The kernel build failed; the message says what to fix."""


# --------------------------------------------------------------------------------------------
# wheels.toml
# --------------------------------------------------------------------------------------------


@dataclass
class Toolkit:
    name: str
    cuda: str
    sm: list[str]
    ptx: bool = False
    primary: bool = False
    full_version: str = ""

    @property
    def suffix(self) -> str:
        return "" if self.primary else f"__{self.name}"


@dataclass
class Matrix:
    sm: list[str]
    ptx: str
    toolkits: list[Toolkit]
    platforms: list[dict] = field(default_factory=list)


def load_matrix(path: Path = ROOT / "wheels.toml") -> Matrix:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    toolkits = [
        Toolkit(name=t["name"], cuda=t["cuda"], sm=list(t["sm"]), ptx=bool(t.get("ptx", False)), primary=i == 0,
                full_version=t.get("full_version", t["cuda"]))
        for i, t in enumerate(data["toolkit"])
    ]
    return Matrix(sm=list(data["kernels"]["sm"]), ptx=data["kernels"]["ptx"], toolkits=toolkits,
                  platforms=list(data.get("platform", [])))


def sm_code(sm: str) -> str:
    """'8.6' -> '86'."""
    major, minor = sm.split(".")
    return f"{major}{minor}"


# --------------------------------------------------------------------------------------------
# Toolchain discovery
# --------------------------------------------------------------------------------------------


def _nvcc_in(home: str | os.PathLike | None) -> Path | None:
    if not home:
        return None
    exe = Path(home) / "bin" / ("nvcc.exe" if IS_WINDOWS else "nvcc")
    return exe if exe.is_file() else None


def find_nvcc(toolkit: Toolkit) -> Path | None:
    """nvcc for a toolkit leg: WLLM_CUDA_HOME_<NAME>, then (primary leg only) CUDA_HOME,
    CUDA_PATH and PATH. A non-primary leg is only built when its toolkit is named explicitly."""
    explicit = _nvcc_in(os.environ.get(f"WLLM_CUDA_HOME_{toolkit.name.upper()}"))
    if explicit or not toolkit.primary:
        return explicit
    for var in ("CUDA_HOME", "CUDA_PATH"):
        found = _nvcc_in(os.environ.get(var))
        if found:
            return found
    which = shutil.which("nvcc")
    return Path(which) if which else None


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release [\d.]+, V([\d.]+)", out)
    if not match:
        raise BuildError(f"could not read the version of {nvcc}: {out!r}")
    return match.group(1)


def msvc_environment() -> dict[str, str] | None:
    """On Windows, the environment of a VS developer prompt (found with vswhere), so users never
    need to run vcvarsall themselves. None when cl.exe is already on PATH or not on Windows."""
    if not IS_WINDOWS or shutil.which("cl"):
        return None
    program_files = os.environ.get("ProgramFiles(x86)", r"C:\Program Files (x86)")
    vswhere = Path(program_files) / "Microsoft Visual Studio" / "Installer" / "vswhere.exe"
    if not vswhere.is_file():
        raise BuildError("MSVC not found: install Visual Studio Build Tools with the C++ workload "
                         f"(vswhere.exe missing at {vswhere})")
    install = subprocess.run(
        [str(vswhere), "-latest", "-products", "*", "-requires",
         "Microsoft.VisualStudio.Component.VC.Tools.x86.x64", "-property", "installationPath"],
        capture_output=True, text=True, check=True).stdout.strip()
    if not install:
        raise BuildError("vswhere found no Visual Studio with the C++ x64 build tools")
    vcvars = Path(install) / "VC" / "Auxiliary" / "Build" / "vcvars64.bat"
    dump = subprocess.run(f'cmd /s /c ""{vcvars}" >nul && set"', capture_output=True, text=True,
                          shell=True, check=True).stdout
    env = {}
    for line in dump.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key] = value
    return env


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


@dataclass
class LegPlan:
    toolkit: Toolkit
    nvcc: Path
    version: str
    sms: list[str]
    ptx_sm: str | None


def default_cache_dir() -> Path:
    env = os.environ.get("WLLM_BUILD_CACHE")
    if env:
        return Path(env)
    if IS_WINDOWS:
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "wllm" / "build-cache"
    return Path.home() / ".cache" / "wllm" / "build-cache"


def plan_legs(matrix: Matrix, archs_override: str | None) -> tuple[list[LegPlan], dict[str, str]]:
    """Which toolkit compiles which SMs here, and which promised SMs cannot be built (and why)."""
    legs: list[LegPlan] = []
    missing: dict[str, str] = {}
    if archs_override:
        primary = matrix.toolkits[0]
        nvcc = find_nvcc(primary)
        if nvcc is None:
            raise BuildError("WLLM_CUDA_ARCHS is set but nvcc was not found (set CUDA_HOME)")
        sms = [a.strip() for a in re.split(r"[;, ]+", archs_override) if a.strip()]
        for sm in sms:
            if not re.fullmatch(r"\d+\.\d", sm):
                raise BuildError(f"WLLM_CUDA_ARCHS entry {sm!r} is not like '9.0'")
        return [LegPlan(primary, nvcc, nvcc_version(nvcc), sms, None)], {}
    for toolkit in matrix.toolkits:
        nvcc = find_nvcc(toolkit)
        if nvcc is None:
            if toolkit.primary:
                raise BuildError("nvcc not found")
            for sm in toolkit.sm:
                missing[sm] = (f"needs the {toolkit.name} leg (CUDA {toolkit.cuda}); "
                               f"set WLLM_CUDA_HOME_{toolkit.name.upper()} to build it")
            continue
        ptx_sm = matrix.ptx if toolkit.ptx else None
        sms = list(toolkit.sm)
        # Test hook: WLLM_LEG_SM_<NAME>="9.0" rebuilds a leg for other SMs (and without PTX), so the
        # loader's fallback from one leg to the next can be exercised on a single GPU.
        leg_override = os.environ.get(f"WLLM_LEG_SM_{toolkit.name.upper()}")
        if leg_override:
            sms, ptx_sm = [a for a in re.split(r"[;, ]+", leg_override) if a], None
        legs.append(LegPlan(toolkit, nvcc, nvcc_version(nvcc), sms, ptx_sm))
    return legs, missing


def _compile_flags(leg: LegPlan) -> list[str]:
    flags = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "--threads", "0",
             f"-DWLLM_SYMBOL_SUFFIX={leg.toolkit.suffix}",
             f"-DWLLM_NS=wllm{leg.toolkit.suffix}"]
    for sm in leg.sms:
        code = sm_code(sm)
        # SM 9.0 as sm_90a: the same GPUs (9.0 is the only 9.x), plus wgmma/setmaxnreg for gemm_sm90.cu.
        code = "90a" if code == "90" else code
        flags.append(f"-gencode=arch=compute_{code},code=sm_{code}")
    if leg.ptx_sm:
        code = sm_code(leg.ptx_sm)
        flags.append(f"-gencode=arch=compute_{code},code=compute_{code}")
    if IS_WINDOWS:
        flags += ["-Xcompiler", "/O2,/EHsc", "-DNOMINMAX"]
    else:
        flags += ["-Xcompiler", "-fPIC,-fvisibility=hidden"]
    return flags


def _link_flags() -> list[str]:
    flags = ["-shared", "-cudart", "static"]
    if not IS_WINDOWS:
        # Only libc stays dynamic; the static C++ runtime's symbols are kept private.
        flags += ["-Xcompiler", "-static-libstdc++,-static-libgcc", "-Xlinker", "--exclude-libs,ALL"]
    return flags


def _ninja_quote(path: Path | str) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _cmd_quote(arg: str) -> str:
    if IS_WINDOWS:
        return subprocess.list2cmdline([arg])
    import shlex

    return shlex.quote(arg)


def _source_key(source: Path, headers: list[Path], flags: list[str], version: str) -> str:
    h = hashlib.sha256()
    for path in [source, *headers]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update("\0".join(flags).encode())
    h.update(version.encode())
    h.update(sys.platform.encode())
    return h.hexdigest()[:24]


def build(out_dir: Path, build_dir: Path | None = None, archs_override: str | None = None,
          jobs: int | None = None, verbose: bool = False, cache_dir: Path | None = None) -> dict:
    """Compile and link the kernel library into out_dir; returns the build info it also writes
    to out_dir/build_info.json."""
    started = time.monotonic()
    matrix = load_matrix()
    archs_override = archs_override if archs_override is not None else os.environ.get("WLLM_CUDA_ARCHS")
    legs, missing = plan_legs(matrix, archs_override)
    csrc = ROOT / "csrc"
    sources = sorted(csrc.glob("*.cu"))
    headers = sorted([*csrc.glob("*.h"), *csrc.glob("*.cuh")])
    build_dir = Path(build_dir or ROOT / "build" / "kernels").resolve()
    obj_dir = build_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    obj_ext = ".obj" if IS_WINDOWS else ".o"

    lines = ["ninja_required_version = 1.3", ""]
    objects: list[Path] = []
    to_cache: list[tuple[Path, Path]] = []
    hits = 0
    for index, leg in enumerate(legs):
        flags = _compile_flags(leg)
        lines.append(f"rule nvcc{index}")
        lines.append(f"  command = {_cmd_quote(str(leg.nvcc))} {' '.join(_cmd_quote(f) for f in flags)} "
                     f"-I{_cmd_quote(str(csrc))} -c $in -o $out")
        lines.append(f"  description = nvcc[{leg.toolkit.name}] $in")
        lines.append("")
        for source in sources:
            # nvcc also reads flags from NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS: they belong in the key.
            env_flags = [os.environ.get(v, "") for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
            key = _source_key(source, headers, flags + env_flags, leg.version)
            obj = obj_dir / f"{source.stem}.{leg.toolkit.name}{obj_ext}"
            cached = cache / f"{source.stem}-{key}{obj_ext}"
            objects.append(obj)
            if cached.is_file():
                shutil.copyfile(cached, obj)
                hits += 1
            else:
                # A miss means the source, a header, the flags or nvcc changed: drop any older object
                # so ninja cannot judge it up to date by timestamps (it does not see header edits),
                # and list the headers as implicit inputs too.
                obj.unlink(missing_ok=True)
                deps = (" | " + " ".join(_ninja_quote(h) for h in headers)) if headers else ""
                lines.append(f"build {_ninja_quote(obj)}: nvcc{index} {_ninja_quote(source)}{deps}")
                to_cache.append((obj, cached))
    primary = legs[0]
    lib = build_dir / LIB_NAME
    link_flags = _link_flags()
    lines.append("rule link")
    lines.append(f"  command = {_cmd_quote(str(primary.nvcc))} {' '.join(link_flags)} $in -o $out")
    lines.append("  description = link $out")
    lines.append(f"build {_ninja_quote(lib)}: link {' '.join(_ninja_quote(o) for o in objects)}")
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # Always relink: cached objects were just copied in and the set of legs may have changed.
    lib.unlink(missing_ok=True)

    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as ninja_pkg  # the PyPI wheel, listed in build-system.requires

            ninja = str(Path(ninja_pkg.BIN_DIR) / ("ninja.exe" if IS_WINDOWS else "ninja"))
        except ImportError as exc:
            raise BuildError("ninja not found: pip install ninja") from exc
    env = os.environ.copy()
    msvc = msvc_environment()
    if msvc:
        env.update(msvc)
    cmd = [ninja, "-C", str(build_dir), "-j", str(jobs or os.cpu_count() or 2)]
    if verbose:
        cmd.append("-v")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise BuildError(f"kernel build failed (ninja exit {proc.returncode}); see the nvcc output above")
    for obj, cached in to_cache:
        tmp = cached.with_suffix(".tmp")
        shutil.copyfile(obj, tmp)
        os.replace(tmp, cached)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(lib, out_dir / LIB_NAME)
    info = {
        "abi_version": int(re.search(r"#define WLLM_ABI_VERSION (\d+)", (csrc / "api.h").read_text()).group(1)),
        "library": LIB_NAME,
        "platform": sys.platform,
        "legs": [
            {"name": leg.toolkit.name, "suffix": leg.toolkit.suffix, "nvcc": leg.version,
             "sm": leg.sms, "ptx": leg.ptx_sm}
            for leg in legs
        ],
        "promised_sm": matrix.sm if not archs_override else [s for leg in legs for s in leg.sms],
        "missing_sm": missing,
        "override": archs_override or None,
        "leg_overrides": {t.name: os.environ[f"WLLM_LEG_SM_{t.name.upper()}"] for t in matrix.toolkits
                          if os.environ.get(f"WLLM_LEG_SM_{t.name.upper()}")},
        "objects_compiled": len(to_cache),
        "objects_from_cache": hits,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    for sm, why in missing.items():
        print(f"wllm kernels: WARNING: no code for SM {sm}: {why}", file=sys.stderr)
    print(f"wllm kernels: built {LIB_NAME} for SM {', '.join(s for leg in legs for s in leg.sms)} "
          f"in {info['build_seconds']} s ({hits} cached objects, {len(to_cache)} compiled)", file=sys.stderr)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "wllm" / "_lib")
    parser.add_argument("--build-dir", type=Path, default=None)
    parser.add_argument("--archs", default=None, help="override the SM list, e.g. '9.0'")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    try:
        build(args.out, args.build_dir, args.archs, args.jobs, args.verbose)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
