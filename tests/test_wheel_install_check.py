"""build_tools/check_wheel_install.py's wheel checks (the install itself runs in .ci/run)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build_tools"))
import check_wheel_install as cwi  # noqa: E402

BASE = ["wllm/__init__.py", "wllm/cli.py", "wllm/_lib/__init__.py", "wllm_server-0.1.0.dist-info/entry_points.txt"]


def wheel(tmp_path: Path, name: str, extra: list[str]) -> Path:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as zf:
        for member in BASE + extra:
            zf.writestr(member, "")
    return path


def test_good_wheels_pass(tmp_path: Path) -> None:
    lib = ["wllm/_lib/libwllm_kernels.so", "wllm/_lib/build_info.json"]
    assert cwi.check_wheel(wheel(tmp_path, "wllm_server-0.1.0-py3-none-linux_x86_64.whl", lib), "yes") == []
    dll = ["wllm/_lib/wllm_kernels.dll", "wllm/_lib/build_info.json"]
    assert cwi.check_wheel(wheel(tmp_path, "wllm_server-0.1.0-py3-none-win_amd64.whl", dll), "yes") == []
    assert cwi.check_wheel(wheel(tmp_path, "wllm_server-0.1.0-py3-none-any.whl", []), "no") == []


def test_bad_wheels_are_named(tmp_path: Path) -> None:
    lib = ["wllm/_lib/libwllm_kernels.so", "wllm/_lib/build_info.json"]
    cases = {
        ("wllm_server-0.1.0-cp312-cp312-linux_x86_64.whl", ()): "must be tagged py3-none-<platform>",
        ("wllm_server-0.1.0-py3-none-any.whl", ("build/kernels/obj/gemv.cuda13.o",)): "carries the build tree",
        ("wllm_server-0.1.0-py3-none-any.whl", ("csrc/api.h",)): "carries the build tree",
        ("wllm_server-0.1.0-py3-none-any.whl", ("wllm/_lib/wllm_kernels.dll",)): "2 kernel libraries",
        ("wllm_server-0.1.0-py3-none-any.whl", ("wllm/_lib/wllm_kernels.lib",)): "unexpected files in wllm/_lib/",
    }
    for (name, extra), message in cases.items():
        problems = cwi.check_wheel(wheel(tmp_path, name, lib + list(extra)), "yes")
        assert any(message in p for p in problems), (name, extra, problems)
    cpu = wheel(tmp_path, "wllm_server-0.1.0-py3-none-any.whl", [])
    assert any("no kernel library" in p for p in cwi.check_wheel(cpu, "yes"))


def test_the_fresh_venv_path_has_no_nvcc(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    toolkit = tmp_path / "toolkit-bin"
    toolkit.mkdir()
    (toolkit / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{toolkit}:/usr/bin:/opt/cuda-13/bin")
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda-13")
    env = cwi.toolkit_free_env(tmp_path / "venv" / "bin")
    assert env["PATH"].split(":") == [str(tmp_path / "venv" / "bin"), "/usr/bin"] and "CUDA_HOME" not in env
