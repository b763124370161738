"""`QuantizedTensor`: a GGML-quantized weight kept as its raw block bytes."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np
import torch

from wllm.model.loader.dequant import GGMLType, block_layout, byte_shape, dequantize
from wllm.model.loader.dequant import ggml_type as _check_type


class QuantizedTensor:
    """A tensor stored as GGML blocks: raw bytes, the GGML type, and the logical shape.

    `data` is a uint8 tensor of shape `byte_shape(shape, ggml_type)`: one row of bytes per
    logical row, because GGML blocks never straddle rows. `shape` is in HF order, e.g.
    [out_features, in_features] for a linear weight. Row operations (`narrow_rows`,
    `index_rows`, `cat`) therefore move whole rows of bytes and never touch the values, which
    is how the llama Q/K un-permute and fused-weight splits stay exact on quantized data.
    """

    __slots__ = ("data", "ggml_type", "shape")

    def __init__(self, data: torch.Tensor, ggml_type: int | GGMLType, shape: Sequence[int]) -> None:
        gt = _check_type(ggml_type)
        shape = tuple(int(s) for s in shape)
        expected = byte_shape(shape, gt)
        if data.dtype != torch.uint8:
            raise ValueError(f"QuantizedTensor data must be uint8 bytes, got {data.dtype}")
        if data.numel() != prod(expected):
            raise ValueError(
                f"{gt.name} tensor of shape {shape} needs {prod(expected)} bytes, got {data.numel()}"
            )
        self.data: torch.Tensor = data.reshape(expected)
        self.ggml_type: GGMLType = gt
        self.shape: tuple[int, ...] = shape

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.ggml_type.name}, shape={self.shape}, device={self.device})"

    @property
    def device(self) -> torch.device:
        """Device of the raw bytes."""
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Size of the raw bytes."""
        return self.data.numel()

    @property
    def ndim(self) -> int:
        """Number of logical dimensions."""
        return len(self.shape)

    @property
    def block_size(self) -> int:
        """Logical values per GGML block."""
        return block_layout(self.ggml_type)[0]

    def numel(self) -> int:
        """Number of logical values."""
        return prod(self.shape)

    def dequantize(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dequantize to a new tensor of the logical shape (or into `out`).

        The values are computed in float32 (bit-exact against gguf.quants) on `device` (default:
        where the bytes are, or `out`'s device; moving the bytes first is cheaper than moving
        float32 values), then cast to `dtype`, chunk by chunk. `out`: a contiguous tensor of the
        logical shape, any floating dtype, that receives the values (saves an allocation and a
        copy when filling a parameter); `dtype` is then ignored.
        """
        if out is not None and device is None:
            device = out.device
        data = self.data if device is None else self.data.to(device)
        return dequantize(data, self.ggml_type, self.shape, dtype=dtype, out=out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedTensor:
        """A copy with the raw bytes on `device` (self if they already are there)."""
        data = self.data.to(device, non_blocking=non_blocking)
        return self if data is self.data else QuantizedTensor(data, self.ggml_type, self.shape)

    def contiguous(self) -> QuantizedTensor:
        """A QuantizedTensor whose bytes are contiguous (self if they already are)."""
        return self if self.data.is_contiguous() else QuantizedTensor(
            self.data.contiguous(), self.ggml_type, self.shape
        )

    def _need_rows(self) -> None:
        if self.ndim < 2:
            raise ValueError(f"row operations need a tensor with at least 2 dims, got shape {self.shape}")

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start + length) along dim 0, as a view of the same bytes."""
        self._need_rows()
        if start < 0 or length < 0 or start + length > self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) out of range for shape {self.shape}")
        return QuantizedTensor(
            self.data.narrow(0, start, length), self.ggml_type, (length, *self.shape[1:])
        )

    def split_rows(self, sizes: Sequence[int]) -> list[QuantizedTensor]:
        """Split dim 0 into consecutive pieces of the given row counts (they must add up)."""
        self._need_rows()
        if sum(sizes) != self.shape[0]:
            raise ValueError(f"split sizes {list(sizes)} do not add up to {self.shape[0]} rows")
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow_rows(start, size))
            start += size
        return out

    def index_rows(self, index: torch.Tensor | Sequence[int]) -> QuantizedTensor:
        """A new QuantizedTensor made of rows `index` (a permutation or selection) along dim 0."""
        self._need_rows()
        idx = torch.as_tensor(index, dtype=torch.long, device=self.data.device)
        if idx.ndim != 1:
            raise ValueError(f"row index must be 1-D, got shape {tuple(idx.shape)}")
        if self.data.device.type == "cpu":
            # numpy gathers on this thread; torch's index_select on a weight-sized tensor opens an
            # OpenMP region, which stalls for milliseconds when the cores are busy.
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.shape[0]):
                raise IndexError(f"row index out of range for {self.shape[0]} rows")
            data = torch.from_numpy(np.take(self.data.numpy(), idx.numpy(), axis=0))
        else:
            data = self.data.index_select(0, idx)
        return QuantizedTensor(data, self.ggml_type, (idx.numel(), *self.shape[1:]))

    @staticmethod
    def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """Concatenate along dim 0 (fusing q/k/v or gate/up); parts must share type and row shape."""
        if not parts:
            raise ValueError("cannot concatenate an empty list of QuantizedTensors")
        first = parts[0]
        first._need_rows()
        for p in parts[1:]:
            if p.ggml_type != first.ggml_type or p.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"cannot concatenate {p.ggml_type.name}{list(p.shape)} with "
                    f"{first.ggml_type.name}{list(first.shape)}: type and row shape must match"
                )
        data = torch.cat([p.data for p in parts], dim=0)
        return QuantizedTensor(data, first.ggml_type, (sum(p.shape[0] for p in parts), *first.shape[1:]))
