"""Shared pytest setup: tests marked `cuda` run only where a GPU and the kernel library are present."""

from __future__ import annotations

import pytest
import torch


def _cuda_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    from wllm import kernels

    try:
        kernels._lib.binding(0)
    except kernels.KernelLibraryError as exc:
        return False, str(exc)
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    ready, why = _cuda_ready()
    if ready:
        return
    skip = pytest.mark.skip(reason=f"needs CUDA kernels: {why}")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
