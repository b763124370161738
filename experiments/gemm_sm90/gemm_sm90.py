"""Hopper (SM 9.0) GEMM on TMA + wgmma, with the gated MLP's activation in its epilogue.

y = x @ W^T; or, with an activation ("silu" / "gelu_tanh") and W = [gate rows | up rows] ([2 n, k]),
y = act(x @ gate^T) * (x @ up^T) ([..., n]), gated from the fp32 accumulators: the gate_up projection and
its activation in one kernel, without the [rows, 2 n] intermediate or the activation kernel's pass over it.
At prefill sizes it runs about as fast as cuBLAS on the projection alone (csrc/gemm_sm90.cu has the
design and the measurements), so the activation comes for free. At decode sizes (a few hundred rows) its
stream-K schedule splits the k-blocks of all output tiles evenly over the SMs, with fp32 partial sums
through a per-device workspace, where whole tiles would leave SMs idle.

SM 9.0 GPUs only (`supported`); `reference_gemm` computes the same thing elsewhere. The op is also a
`torch.library.custom_op` (`wllm::gemm_sm90`) for torch.compile; eager CUDA calls take the raw binding.

Kept out of the shipped package (see README.md here): to run it again, put gemm_sm90.cu back into csrc/,
its three entry points back into csrc/api.h and their signatures into wllm/kernels/_lib.py's SIGNATURES.
"""

from __future__ import annotations

import functools

import torch

from wllm.kernels import _lib

# The C ABI's dtype and activation codes, the same as wllm_gemv's (its prologue codes are our epilogues).
from wllm.kernels.gemv import _DTYPES
from wllm.kernels.gemv import PROLOGUES as EPILOGUES
from wllm.kernels.ops import _is_compiling, _rows, _stream, persistent_workspace
from wllm.kernels.reference import act_and_mul

# The C ABI's schedule codes: auto chooses stream-K where whole tiles would leave SMs idle.
SCHEDULES: dict[str, int] = {"auto": 0, "tiles": 1, "stream_k": 2}


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


def _check(x: torch.Tensor, weight: torch.Tensor, activation: str | None, schedule: str = "auto") -> int:
    """Validate; returns the output width. Raises ValueError saying what is wrong."""
    if schedule not in SCHEDULES:
        raise ValueError(f"gemm_sm90: unknown schedule {schedule!r}; supported: {', '.join(SCHEDULES)}")
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


def reference_gemm(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """x @ weight^T in fp32, rounded once to x's dtype. With an activation ("silu" or "gelu_tanh") weight is
    [gate rows | up rows] and the result is act(x @ gate^T) * (x @ up^T) of the fp32 products, rounded once:
    [..., out / 2] (the kernel's gated epilogue)."""
    y = x.float() @ weight.float().t()
    return y.to(x.dtype) if activation is None else act_and_mul(y, activation).to(x.dtype)


# The stream-K workspace per device (128 KB per SM; without one, e.g. captured first, whole tiles only).
_WORKSPACES: dict[int, torch.Tensor] = {}


def _cuda_gemm(x: torch.Tensor, weight: torch.Tensor, activation: str | None, schedule: str = "auto") -> torch.Tensor:
    n = _check(x, weight, activation, schedule)
    k = weight.shape[1]
    x2 = _rows(x if x.stride(-1) == 1 else x.contiguous(), k, "gemm_sm90")
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    # Output rows padded to a multiple of 8 elements when n is not (the TMA stores need 16-byte row steps).
    ldc = -(-n // 8) * 8
    out = torch.empty((x2.shape[0], ldc), dtype=x.dtype, device=x.device)[:, :n]
    lib = _lib.binding(x.device.index or 0)
    workspace = persistent_workspace(_WORKSPACES, x.device, lib, "wllm_gemm_sm90_workspace_size")
    lib.check(lib.wllm_gemm_sm90(out.data_ptr(), x2.data_ptr(), w.data_ptr(), x2.shape[0], n, k, x2.stride(0),
                                 w.stride(0), ldc, EPILOGUES[activation], _DTYPES[x.dtype],
                                 workspace.data_ptr() if workspace is not None else None,
                                 workspace.numel() if workspace is not None else 0, SCHEDULES[schedule], _stream(x)),
              "gemm_sm90")
    return out.reshape(*x.shape[:-1], n) if ldc == n else out.contiguous().reshape(*x.shape[:-1], n)


@torch.library.custom_op("wllm::gemm_sm90", mutates_args=())
def gemm_sm90_op(x: torch.Tensor, weight: torch.Tensor, activation: str | None, schedule: str) -> torch.Tensor:
    return _cuda_gemm(x, weight, activation, schedule) if x.is_cuda else reference_gemm(x, weight, activation)


@gemm_sm90_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, activation: str | None, schedule: str) -> torch.Tensor:
    n = weight.shape[0] if activation is None else weight.shape[0] // 2
    return x.new_empty((*x.shape[:-1], n))


def gemm_sm90(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None,
              schedule: str = "auto") -> torch.Tensor:
    """x @ weight^T, or act(x @ gate^T) * (x @ up^T) for weight = [gate rows | up rows] with an activation
    ("silu" / "gelu_tanh"). The Hopper kernel on SM 9.0 GPUs, the fp32 reference elsewhere (CPU tensors,
    other GPUs). schedule: "auto" (stream-K where whole output tiles would leave SMs idle), "tiles" or
    "stream_k" (for measurements and tests; the result is the same up to fp32 summation order)."""
    if not x.is_cuda or not supported(x.device.index or 0):
        _check(x, weight, activation, schedule)
        return reference_gemm(x, weight, activation)
    if _is_compiling():
        return gemm_sm90_op(x, weight, activation, schedule)
    return _cuda_gemm(x, weight, activation, schedule)
