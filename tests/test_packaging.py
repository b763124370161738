"""Packaging: without nvcc (or with WLLM_NO_KERNELS=1) the build is a pure-Python, CPU-only wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_builds_wheels() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except PackageNotFoundError:
        return False
    return (major, minor) >= (70, 1)


@pytest.mark.slow
@pytest.mark.skipif(not _setuptools_builds_wheels(), reason="needs setuptools >= 70.1 to build without isolation")
def test_cpu_only_wheel_without_kernels(tmp_path: Path) -> None:
    env = dict(os.environ, WLLM_NO_KERNELS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("wllm_server-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "wllm/kernels/ops.py" in names and "wllm/cli.py" in names
    ui = {n.rsplit("/", 1)[1] for n in names if n.startswith("wllm/entrypoints/ui/static/")}  # the web UI
    assert ui == {p.name for p in (ROOT / "wllm" / "entrypoints" / "ui" / "static").iterdir()}, ui
    assert not [n for n in names if n.startswith("wllm/_lib/") and not n.endswith("__init__.py")]
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Name: wllm-server" in meta and "Requires-Python: >=3.10" in meta
    assert "Requires-Dist: torch>=2.4" in meta
