"""Hopper (SM 9.0) GEMM on TMA + wgmma, with the gated MLP's activation in its epilogue.

y = x @ W^T; or, with an activation ("silu" / "gelu_tanh") and W = [gate rows | up rows] ([2 n, k]),
y = act(x @ gate^T) * (x @ up^T) ([..., n]), gated from the fp32 accumulators: the gate_up projection and
its activation in one kernel, without the [rows, 2 n] intermediate or the activation kernel's pass over it.
At prefill sizes it runs about as fast as cuBLAS on the projection alone (csrc/gemm_sm90.cu has the
design and the measurements), so the activation comes for free.

SM 9.0 GPUs only (`supported`); `reference.gemm` computes the same thing elsewhere. The op is also a
`torch.library.custom_op` (`wllm::gemm_sm90`) for torch.compile; eager CUDA calls take the raw binding.
"""

from __future__ import annotations

import functools

import torch

from wllm.kernels import _lib, reference

# The C ABI's dtype and activation codes, the same as wllm_gemv's (its prologue codes are our epilogues).
from wllm.kernels.gemv import _DTYPES
from wllm.kernels.gemv import PROLOGUES as EPILOGUES
from wllm.kernels.ops import _is_compiling, _rows, _stream


@functools.cache
def supported(device: int = 0) -> bool:
    """True when the kernel runs on this CUDA device (an SM 9.0 GPU with the kernel library loaded)."""
    if not _lib.available(device):
        return False
    with torch.cuda.device(device):
        return bool(_lib.binding(device).wllm_gemm_sm90_supported())


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The layout the kernel's TMA loads need: fp16/bf16, 16-byte aligned, row strides multiples of 8
    elements (checked without raising, for dispatch)."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.stride(0) % 8 or weight.shape[1] % 8:
        return False
    if x.dim() > 1 and x.stride(-2) % 8:  # the row stride the kernel is given (x is viewed as rows)
        return False
    return x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0


def _check(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> int:
    """Validate; returns the output width. Raises ValueError saying what is wrong."""
    if activation not in EPILOGUES:
        raise ValueError(f"gemm_sm90: unknown activation {activation!r}; supported: None, 'silu', 'gelu_tanh'")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"gemm_sm90: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         "(weight is [out_features, in_features])")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"gemm_sm90: float16 or bfloat16 x and weight of one dtype, got {x.dtype} and "
                         f"{weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"gemm_sm90: x on {x.device}, weight on {weight.device}")
    if activation is not None and weight.shape[0] % 2:
        raise ValueError(f"gemm_sm90: a gated output needs [gate | up] weight rows, an even count; got "
                         f"{weight.shape[0]}")
    return weight.shape[0] if activation is None else weight.shape[0] // 2


def _cuda_gemm(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    n = _check(x, weight, activation)
    k = weight.shape[1]
    x2 = _rows(x if x.stride(-1) == 1 else x.contiguous(), k, "gemm_sm90")
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    # Output rows padded to a multiple of 8 elements when n is not (the TMA stores need 16-byte row steps).
    ldc = -(-n // 8) * 8
    out = torch.empty((x2.shape[0], ldc), dtype=x.dtype, device=x.device)[:, :n]
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_gemm_sm90(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], n, k, x2.stride(0),
                                 w.stride(0), ldc, EPILOGUES[activation], _DTYPES[x.dtype], _stream(x)), "gemm_sm90")
    return out.reshape(*x.shape[:-1], n) if ldc == n else out.contiguous().reshape(*x.shape[:-1], n)


@torch.library.custom_op("wllm::gemm_sm90", mutates_args=())
def gemm_sm90_op(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    return _cuda_gemm(x, weight, activation) if x.is_cuda else reference.gemm(x, weight, activation)


@gemm_sm90_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    n = weight.shape[0] if activation is None else weight.shape[0] // 2
    return x.new_empty((*x.shape[:-1], n))


def gemm_sm90(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """x @ weight^T, or act(x @ gate^T) * (x @ up^T) for weight = [gate rows | up rows] with an activation
    ("silu" / "gelu_tanh"). The Hopper kernel on SM 9.0 GPUs, the fp32 reference elsewhere (CPU tensors,
    other GPUs)."""
    if not x.is_cuda or not supported(x.device.index or 0):
        _check(x, weight, activation)
        return reference.gemm(x, weight, activation)
    if _is_compiling():
        return gemm_sm90_op(x, weight, activation)
    return _cuda_gemm(x, weight, activation)
