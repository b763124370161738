"""Linear layers whose weights load from HF tensors, fused shards, or GGUF quantized tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from wllm.model.layers.linear_method import DenseLinearMethod, KernelChoice, KernelTarget, LinearMethod


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


class Linear(KernelChoice, nn.Module):
    """y = x W^T (+ b); weight [out_features, in_features] like nn.Linear, but never initialised
    (weights always come from a checkpoint or the dummy loader). Its `method` (a LinearMethod, dense by
    default) owns the weight's layout and the kernel choice, made once the weights are loaded
    (linear_method.select_kernels)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = DenseLinearMethod() if method is None else method
        self.method.create_weights(self, in_features, out_features, bias)

    def choose_kernels(self, target: KernelTarget | None) -> None:
        self.method.process_weights_after_loading(self, target)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """x W^T (+ b). Given `residual` (rows of out_features), a batch that runs on cuBLAS adds into it
        instead, in the GEMM's epilogue (residual += x W^T, beta = 1, rounded once), and returns None; other
        paths return the product as usual and leave the add to the caller."""
        return self.method.apply(self, x, residual)

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
