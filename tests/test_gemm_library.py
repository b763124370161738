"""EngineConfig.gemm_library: which BLAS library torch's GEMMs use on CUDA (CPU-testable logic)."""

from __future__ import annotations

import pytest
import torch

from wllm.engine import model_runner
from wllm.engine.config import EngineConfig, engine_config_from_kwargs


def test_bad_gemm_library_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="gemm_library must be 'auto', 'cublas' or 'cublaslt'"):
        EngineConfig(gemm_library="rocblas").validate()
    assert engine_config_from_kwargs(gemm_library="cublas").gemm_library == "cublas"


def test_off_cuda_nothing_is_touched(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library",
                        lambda *a: pytest.fail("touched torch's BLAS setting off CUDA"))
    assert model_runner.select_gemm_library("cublaslt", torch.device("cpu")) is None


@pytest.mark.parametrize(("choice", "capability", "expected"), [
    ("auto", (9, 0), "cublaslt"),  # Hopper: measured faster
    ("auto", (8, 0), None),  # elsewhere torch's own default stays
    ("auto", (12, 0), None),
    ("cublas", (9, 0), "cublas"),
    ("cublaslt", (7, 5), "cublaslt"),
])
def test_selection(monkeypatch, choice, capability, expected):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def preferred(backend=None):
        if backend is not None:
            calls.append(backend)
        return "_BlasBackend.Cublaslt" if calls and calls[-1] == "cublaslt" else "_BlasBackend.Cublas"

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    in_use = model_runner.select_gemm_library(choice, torch.device("cuda", 0))
    assert calls == ([expected] if expected else [])
    assert in_use == (expected or "cublas")
