"""wheels.toml, the cibuildwheel config in pyproject.toml and .github/workflows/wheels.yml must agree."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_tools"))

import kernel_build  # noqa: E402
import matrix as matrix_cli  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROMISED_SM = ["7.0", "7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]


@pytest.fixture(scope="module")
def matrix() -> kernel_build.Matrix:
    return kernel_build.load_matrix()


@pytest.fixture(scope="module")
def cibw() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["cibuildwheel"]


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / "wheels.yml").read_text(encoding="utf-8"))


def test_sm_list_and_ptx(matrix: kernel_build.Matrix) -> None:
    assert matrix.sm == PROMISED_SM
    newest = max(matrix.sm, key=lambda s: tuple(map(int, s.split("."))))
    assert matrix.ptx == newest


def test_toolkit_legs_cover_every_sm_once(matrix: kernel_build.Matrix) -> None:
    covered = [sm for t in matrix.toolkits for sm in t.sm]
    assert sorted(covered) == sorted(matrix.sm), "each promised SM must be built by exactly one leg"
    assert sum(t.ptx for t in matrix.toolkits) == 1
    assert matrix.toolkits[0].primary and not any(t.primary for t in matrix.toolkits[1:])
    for t in matrix.toolkits:
        major = int(t.cuda.split(".")[0])
        assert t.full_version.startswith(t.cuda + ".")
        if "7.0" in t.sm:
            assert major == 12, "CUDA 13 cannot build SM 7.0: it needs a CUDA 12.x leg"
        if major >= 13:
            assert "7.0" not in t.sm


def test_platforms(matrix: kernel_build.Matrix) -> None:
    names = {p["name"] for p in matrix.platforms}
    assert names == {"linux-x86_64", "windows-amd64"}
    for p in matrix.platforms:
        if p["name"].startswith("linux"):
            assert p["cibw_build"].endswith("manylinux_x86_64") and p["cibw_archs"] == "x86_64"
            assert p["runner"].startswith("ubuntu")
        else:
            assert p["cibw_build"].endswith("win_amd64") and p["cibw_archs"] == "AMD64"
            assert p["runner"].startswith("windows")


def test_cibuildwheel_points_every_leg_at_its_toolkit(matrix: kernel_build.Matrix, cibw: dict) -> None:
    linux_env = cibw["linux"]["environment"]
    want = dict(line.split("=", 1) for line in _matrix_cli("env", "linux").splitlines())
    assert linux_env == want
    assert sorted(cibw["windows"]["environment-pass"]) == sorted(f"WLLM_CUDA_HOME_{t.name.upper()}"
                                                                 for t in matrix.toolkits)
    assert "install_cuda_linux.sh" in cibw["linux"]["before-all"]
    assert cibw["linux"]["manylinux-x86_64-image"] == next(
        p["manylinux_image"] for p in matrix.platforms if p["name"] == "linux-x86_64")


def test_workflow_builds_the_matrix_from_wheels_toml(matrix: kernel_build.Matrix, workflow: dict) -> None:
    jobs = workflow["jobs"]
    matrix_steps = " ".join(step.get("run", "") for step in jobs["matrix"]["steps"])
    assert "build_tools/matrix.py github" in matrix_steps
    build = jobs["build"]
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.matrix.outputs.matrix) }}"
    assert build["runs-on"] == "${{ matrix.runner }}"
    steps = build["steps"]
    cibw_step = next(s for s in steps if str(s.get("uses", "")).startswith("pypa/cibuildwheel"))
    assert cibw_step["env"] == {"CIBW_BUILD": "${{ matrix.cibw_build }}", "CIBW_ARCHS": "${{ matrix.cibw_archs }}"}
    runs = [s.get("run", "") for s in steps]
    audit = next(r for r in runs if "audit_wheel.py" in r)
    assert "--toolkits" not in audit, "release wheels are audited against every leg"
    assert any("install_cuda_windows.ps1" in r for r in runs)
    # The matrix the workflow will see is exactly wheels.toml's platforms.
    include = json.loads(_matrix_cli("github"))["include"]
    assert [e["platform"] for e in include] == [p["name"] for p in matrix.platforms]


def test_install_scripts_read_the_toolkits_from_wheels_toml() -> None:
    for script in ("install_cuda_linux.sh", "install_cuda_windows.ps1"):
        assert re.search(r"matrix\.py\"? toolkits", (ROOT / "build_tools" / script).read_text(encoding="utf-8"))
    lines = _matrix_cli("toolkits").splitlines()
    assert [line.split()[0] for line in lines] == [t.name for t in kernel_build.load_matrix().toolkits]


def test_arch_flags(matrix: kernel_build.Matrix) -> None:
    leg = kernel_build.LegPlan(matrix.toolkits[0], Path("nvcc"), "13.0", ["8.6", "9.0"], "12.0")
    flags = kernel_build._compile_flags(leg)
    assert "-gencode=arch=compute_86,code=sm_86" in flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert "-gencode=arch=compute_120,code=compute_120" in flags
    assert "-DWLLM_SYMBOL_SUFFIX=" in flags
    second = kernel_build.LegPlan(matrix.toolkits[1], Path("nvcc"), "12.9", ["7.0"], None)
    assert f"-DWLLM_SYMBOL_SUFFIX=__{matrix.toolkits[1].name}" in kernel_build._compile_flags(second)


def _matrix_cli(*args: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "build_tools" / "matrix.py"), *args], capture_output=True,
                          text=True, check=True).stdout


def test_matrix_cli_rejects_unknown_command() -> None:
    assert matrix_cli.main(["bogus"]) == 2


def test_audit_refuses_a_library_with_an_unresolved_symbol(tmp_path: Path) -> None:
    """A symbol no object defines links into a shared library silently; the audit loads the library, as
    `wllm.kernels` will, so such a wheel fails CI instead of every user's kernel path."""
    import shutil

    import audit_wheel

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform == "win32":
        pytest.skip("needs a C compiler that builds ELF shared libraries")
    src = tmp_path / "lib.c"
    src.write_text("extern int wllm_defined_nowhere(void);\nint entry(void) { return wllm_defined_nowhere(); }\n")
    bad, good = tmp_path / "bad.so", tmp_path / "good.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(bad)], check=True)
    src.write_text("int entry(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(good)], check=True)
    assert "wllm_defined_nowhere" in (audit_wheel.load_problem(bad) or "")
    assert audit_wheel.load_problem(good) is None
