"""Linear layers whose weights load from HF tensors, fused shards, or GGUF quantized tensors."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wllm.kernels import available as kernels_available
from wllm.kernels import gemm_sm90, gemv
from wllm.kernels.gemm_sm90 import fits as gemm_sm90_fits
from wllm.kernels.gemm_sm90 import supported as gemm_sm90_supported
from wllm.kernels.gemv import GEMV_MAX_IN_FEATURES


def _env_int(name: str, default: int) -> int:
    """An integer switch from the environment; a malformed value warns and keeps the default."""
    text = os.environ.get(name, str(default))
    try:
        return int(text)
    except ValueError:
        warnings.warn(f"{name}={text!r} is not an integer; using {default}", stacklevel=2)
        return default


# Which decode matmuls take the skinny-GEMM kernel instead of cuBLAS, from the H200 measurements
# (benchmarks/kernels_gemv.py and A/B runs of `wllm bench latency`, RESULTS.md): up to GEMV_MAX_ROWS
# rows when the weight is at most GEMV_SMALL_WEIGHT_BYTES (Qwen2.5-0.5B's qkv, o, down: 1.1-1.5x at
# 1-2 rows; its 17 MB gate_up: 1,193 -> 1,294 tok/s end to end once the down projection behind it could
# load its weights before the PDL wait, which a cuBLAS predecessor does not allow), and one row when K is
# at least GEMV_WIDE_MIN_K and the weight at most GEMV_MAX_WEIGHT_BYTES (Llama-3.1-8B's qkv, o, down
# 1.03-1.16x; gate_up ties alone but with PDL the whole step gains ~1%). Elsewhere cuBLAS ties or beats the
# CUDA-core kernels (anything at 4+ rows), hence the tensor-core rule below for batches.
GEMV_MAX_ROWS = 2
# 3..GEMV_MMA_MAX_ROWS rows (batched decode) of a weight up to GEMV_MMA_MAX_WEIGHT_BYTES go to the skinny
# GEMM's tensor-core kernel (SM 8.0+, K a multiple of 32). H200, CUDA graphs (benchmarks/kernels_gemv.py,
# RESULTS.md session 6): Qwen2.5-0.5B's qkv / o / down at 4-16 rows 1.6-1.8x / 1.6-2.1x / 1.03-1.16x of
# cuBLAS; its 17 MB gate_up 0.80-0.92x and Llama-3.1-8B's 34-235 MB matrices 0.85-1.19x (mostly below), so
# larger weights stay on cuBLAS. WLLM_GEMV_MMA_MAX_ROWS=0 keeps every such batch on cuBLAS (A/B runs).
GEMV_MMA_MAX_ROWS = _env_int("WLLM_GEMV_MMA_MAX_ROWS", 16)
GEMV_MMA_MAX_WEIGHT_BYTES = 10 << 20
GEMV_SMALL_WEIGHT_BYTES = 18 << 20
GEMV_WIDE_MIN_K = 2048
GEMV_MAX_WEIGHT_BYTES = 256 << 20
_GEMV_DTYPES = (torch.float16, torch.bfloat16)


def _row_range(text: str) -> tuple[int, int]:
    """The row range in "lo,hi" (or one number); anything else is off, (0, 0), with a warning saying why."""
    lo, _, hi = text.partition(",")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        warnings.warn(f"WLLM_SM90_GEMM_ROWS={text!r} is not 'lo,hi' (two integers); the Hopper GEMM stays off",
                      stacklevel=2)
        return 0, 0


# Batches of SM90_GEMM_ROWS[0]..SM90_GEMM_ROWS[1] rows on an SM 9.0 GPU take our Hopper GEMM
# (wllm.kernels.gemm_sm90) instead of cuBLAS, bias-free weights only: its stream-K schedule keeps every SM
# busy at decode sizes, where cuBLAS's tiles leave some idle, and the gated MLP's gate_up adds its
# activation for free (GatedMLP). WLLM_SM90_GEMM_ROWS="lo,hi" sets the range ("0,0": never).
SM90_GEMM_ROWS = _row_range(os.environ.get("WLLM_SM90_GEMM_ROWS", "0,0"))

# Projections whose output is added to the residual stream (o, down) add it inside cuBLAS's epilogue
# (residual += x W^T, beta = 1) when they run on cuBLAS, so the RMSNorm after them reads one tensor and
# writes one instead of the fused add-and-norm's two and two. WLLM_GEMM_RESIDUAL=0 turns it off (A/B runs).
GEMM_RESIDUAL = os.environ.get("WLLM_GEMM_RESIDUAL", "1") != "0"


@functools.cache
def _tensor_cores(index: int) -> bool:
    """The skinny GEMM's tensor-core kernel runs on this CUDA device (SM 8.0+)."""
    return torch.cuda.get_device_capability(index)[0] >= 8


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (or shard) it is meant for."""


def materialize(
    tensor: Any, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Return a dense tensor: plain tensors pass through, quantized ones are dequantized.

    GGUF quantized weights arrive as `QuantizedTensor`s (anything with
    `dequantize(dtype, device)`); we store them dense in the model dtype, dequantized once at
    load on the parameter's device (moving the packed bytes is cheaper than moving floats).
    """
    if isinstance(tensor, torch.Tensor):
        return tensor
    dequant = getattr(tensor, "dequantize", None)
    if dequant is None:
        raise WeightShapeError(f"cannot load a weight of type {type(tensor).__name__}")
    return dequant(dtype=dtype, device=device)


def copy_into(dst: torch.Tensor, src: Any) -> None:
    """Copy `src` into `dst` (any device/dtype), raising WeightShapeError on a shape mismatch."""
    shape = getattr(src, "shape", None)
    if shape is not None and tuple(shape) != tuple(dst.shape):
        raise WeightShapeError(f"checkpoint shape {tuple(shape)} != model shape {tuple(dst.shape)}")
    if not isinstance(src, torch.Tensor) and hasattr(src, "dequantize") and dst.is_contiguous():
        # Dequantize straight into the parameter: no temporary, no second full-size copy.
        with torch.no_grad():
            src.dequantize(out=dst)
        return
    src = materialize(src, dst.dtype, dst.device)
    if tuple(src.shape) != tuple(dst.shape):
        raise WeightShapeError(f"checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class Linear(nn.Module):
    """y = x W^T (+ b); weight [out_features, in_features] like nn.Linear, but never initialised
    (weights always come from a checkpoint or the dummy loader)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def use_gemv(self, x: torch.Tensor, width: int | None = None) -> bool:
        """True when x (rows of `width` elements, in_features by default) should go through the
        skinny-GEMM kernel: CUDA, fp16/bf16 like the weight, kernels present, and either at most
        GEMV_MAX_ROWS rows (the rules below) or up to GEMV_MMA_MAX_ROWS rows of a plain x for its
        tensor-core kernel (weights up to GEMV_MMA_MAX_WEIGHT_BYTES)."""
        width = self.in_features if width is None else width
        if not (x.is_cuda and x.dtype in _GEMV_DTYPES and self.weight.dtype == x.dtype and x.shape[-1] == width
                and 0 < x.numel() <= max(GEMV_MAX_ROWS, GEMV_MMA_MAX_ROWS) * width
                and self.in_features <= GEMV_MAX_IN_FEATURES):
            return False
        index = x.device.index or 0
        nbytes = self.weight.numel() * self.weight.element_size()
        if x.numel() > GEMV_MAX_ROWS * width:
            return (width == self.in_features and self.in_features % 32 == 0 and self.weight.stride(0) % 8 == 0
                    and nbytes <= GEMV_MMA_MAX_WEIGHT_BYTES and _tensor_cores(index) and kernels_available(index))
        wide_one_row = x.numel() == width and self.in_features >= GEMV_WIDE_MIN_K and nbytes <= GEMV_MAX_WEIGHT_BYTES
        return (nbytes <= GEMV_SMALL_WEIGHT_BYTES or wide_one_row) and kernels_available(index)

    def use_sm90(self, x: torch.Tensor) -> bool:
        """True when x should go through the Hopper GEMM with this layer's weight (SM90_GEMM_ROWS rows,
        SM 9.0, no bias, a layout its TMA loads take)."""
        lo, hi = SM90_GEMM_ROWS
        if hi <= 0:  # the default: off, decided before any tensor is looked at (eager decode is host-bound)
            return False
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if not (0 < rows and lo <= rows <= hi and x.is_cuda and self.bias is None):
            return False
        return gemm_sm90_supported(x.device.index or 0) and gemm_sm90_fits(x, self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T (+ b). Given `residual` (rows of out_features), a batch that runs on cuBLAS adds into it
        instead, in the GEMM's epilogue (residual += x W^T, beta = 1, rounded once), and returns None; other
        paths return the product as usual and leave the add to the caller."""
        if self.use_gemv(x):
            return gemv(x, self.weight, self.bias)
        if self.use_sm90(x):
            return gemm_sm90(x, self.weight)
        if residual is not None and self._adds_into(x, residual):
            residual.addmm_(x, self.weight.t())
            return None
        return F.linear(x, self.weight, self.bias)

    def _adds_into(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """The cuBLAS call can add into `residual`: switched on, CUDA, no bias, 2-D x and residual of matching
        shapes and one dtype."""
        return (GEMM_RESIDUAL and x.is_cuda and self.bias is None and x.dim() == 2 and residual.dim() == 2
                and residual.shape == (x.shape[0], self.out_features) and residual.dtype == x.dtype
                and self.weight.dtype == x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up).

    One matmul instead of several; checkpoint tensors for each part load into their slice via
    `load_shard(param, tensor, shard_id)`, and a checkpoint that is already fused (Phi-3)
    loads whole with shard_id None.
    """

    def __init__(self, in_features: int, shard_sizes: Sequence[int], shard_ids: Sequence[str], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for sid, size in zip(shard_ids, shard_sizes, strict=True):
            offsets[sid] = (start, size)
            start += size
        self.shard_offsets = offsets
        self.shard_sizes = list(shard_sizes)

    def load_shard(self, param: torch.Tensor, loaded: Any, shard_id: str | None = None) -> None:
        """Copy a checkpoint tensor into `param` (our weight or bias): whole when shard_id is
        None, else into the slice of that part."""
        if shard_id is None:
            copy_into(param.data, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise WeightShapeError(f"unknown shard {shard_id!r}; expected one of {sorted(self.shard_offsets)}")
        start, size = self.shard_offsets[shard_id]
        copy_into(param.data.narrow(0, start, size), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output of this layer into its parts (views, no copy)."""
        return tuple(y.split(self.shard_sizes, dim=-1))


class QKVLinear(MergedLinear):
    """Fused q/k/v projection for grouped-query attention."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, (q, kv, kv), ("q", "k", "v"), bias)
