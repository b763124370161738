"""Pure-PyTorch dequantization of GGML/GGUF tensor data.

Every function here takes the raw bytes of a GGUF tensor (a uint8 torch tensor, on any device)
and returns float32 values in the tensor's logical shape. The results are bit-exact against
`gguf.quants.dequantize` (llama.cpp's Python reference): the same float32 operations are done in
the same order (scale products first, then `d * q - m`), each rounded on its own. That makes this
module the oracle for future CUDA dequant-GEMM kernels, so it stays in plain torch ops.

Block layouts (bytes per block, values per block) follow ggml-common.h:
Q4_0 (18, 32), Q4_1 (20, 32), Q5_0 (22, 32), Q5_1 (24, 32), Q8_0 (34, 32),
Q2_K (84, 256), Q3_K (110, 256), Q4_K (144, 256), Q5_K (176, 256), Q6_K (210, 256).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from wllm.model.loader.errors import UnsupportedQuantTypeError

GGMLType = GGMLQuantizationType

# Blocks dequantized per vectorised step: bounds the temporaries to a few hundred MB even for a
# 128k-vocab embedding, while still being one big tensor op per step.
_CHUNK_BLOCKS = 1 << 16


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 field at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _unpack(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., len(shifts), k]: field i of each byte is (byte >> shifts[i]) & mask."""
    s = _shifts(shifts, x).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., 2, k]: low nibbles first, then high nibbles."""
    return _unpack(x, (0, 4), 0x0F)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., 8, k]: bit 0 of each byte first."""
    return _unpack(x, range(8), 0x01)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).reshape(n, 32).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).reshape(n, 32).to(torch.float32)
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The 4 qh bytes as a little-endian uint32 bit field -> bit j for value j, as uint8 [n, 32]."""
    # Byte i holds bits 8i..8i+7: unpack to [n, bit, byte], then order byte-major.
    return _bits(qh).transpose(-1, -2).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qh = _q5_high(b[:, 2:6])
    ql = _nibbles(b[:, 6:22]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _q5_high(b[:, 4:8])
    ql = _nibbles(b[:, 8:24]).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] | qs[64] | d | dmin
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # Each 32-byte half holds 4 groups of 2-bit values (shifts 0, 2, 4, 6) of 32 values each.
    q = _unpack(b[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 0x03)
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] | d
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 6-bit scales: low 4 bits from nibbles of bytes 0..7, high 2 bits from 2-bit fields of bytes 8..11.
    low = _nibbles(scales[:, 0:8]).reshape(n, 16)
    high = _unpack(scales[:, 8:12], (0, 2, 4, 6), 0x03).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * sc).reshape(n, 16, 1)
    ql = _unpack(qs.reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16)
    qh = _bits(hmask).reshape(n, 16, 16)
    # A set hmask bit means "no -4 offset".
    q = (ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte block of eight 6-bit scales and eight 6-bit mins used by Q4_K and Q5_K."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48]).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] | qh[64] | scales[16] (int8) | d
    n = b.shape[0]
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    dl = (d * sc).reshape(n, 16, 1)
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _unpack(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, 256)


_BLOCK_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}

_FLOAT_DTYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

#: Every GGML type this module can dequantize, in GGML enum order.
SUPPORTED_TYPES: tuple[GGMLType, ...] = tuple(sorted({*_FLOAT_DTYPES, *_BLOCK_DEQUANT}, key=int))


def supported_type_names() -> str:
    """Comma-separated names of the supported GGML types, for error messages."""
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def ggml_type(t: int | GGMLType | str) -> GGMLType:
    """Normalise a GGML type given as enum, int or name; raise if wLLM does not support it."""
    try:
        gt = GGMLType[t.upper()] if isinstance(t, str) else GGMLType(int(t))
    except (KeyError, ValueError):
        raise UnsupportedQuantTypeError(
            f"unknown GGML tensor type {t!r}; supported types: {supported_type_names()}"
        ) from None
    if gt not in SUPPORTED_TYPES:
        raise UnsupportedQuantTypeError(
            f"GGML tensor type {gt.name} is not supported; supported types: {supported_type_names()}"
        )
    return gt


def is_float_type(t: int | GGMLType) -> bool:
    """True for the unquantized storage types (F32, F16, BF16)."""
    return GGMLType(int(t)) in _FLOAT_DTYPES


def float_dtype(t: int | GGMLType) -> torch.dtype:
    """The torch dtype of an unquantized GGML type (F32, F16, BF16)."""
    return _FLOAT_DTYPES[GGMLType(int(t))]


def block_layout(t: int | GGMLType) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported GGML type."""
    return GGML_QUANT_SIZES[ggml_type(t)]


def byte_shape(shape: Sequence[int], t: int | GGMLType) -> tuple[int, ...]:
    """Shape of the raw byte tensor holding a tensor of logical `shape`: rows stay, the last dim packs."""
    block, nbytes = block_layout(t)
    if len(shape) == 0 or shape[-1] % block != 0:
        raise ValueError(
            f"a {GGMLType(int(t)).name} tensor needs a last dimension that is a multiple of {block}, "
            f"got shape {tuple(shape)}"
        )
    return (*shape[:-1], shape[-1] // block * nbytes)


def dequantize(data: torch.Tensor, t: int | GGMLType, shape: Sequence[int]) -> torch.Tensor:
    """Dequantize raw GGUF bytes to a new float32 tensor of the logical `shape` on `data`'s device.

    `data` is a uint8 tensor holding exactly the tensor's blocks in file order (any shape; it is
    flattened). `shape` is in PyTorch/HF order (row-major, last dimension contiguous), i.e. the
    reverse of the GGUF `ne` order. Raises UnsupportedQuantTypeError for types not in
    SUPPORTED_TYPES and ValueError when the byte count does not match the shape.
    """
    gt = ggml_type(t)
    shape = tuple(int(s) for s in shape)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize expects raw uint8 bytes, got a {data.dtype} tensor")
    expected = prod(byte_shape(shape, gt))
    if data.numel() != expected:
        raise ValueError(
            f"{gt.name} tensor of shape {shape} needs {expected} bytes, got {data.numel()}"
        )
    flat = data.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if gt in _FLOAT_DTYPES:
        # clone: the result must never alias the (possibly memory-mapped, read-only) source bytes.
        return flat.view(_FLOAT_DTYPES[gt]).to(torch.float32, copy=True).reshape(shape)
    block, nbytes = GGML_QUANT_SIZES[gt]
    fn = _BLOCK_DEQUANT[gt]
    blocks = flat.view(-1, nbytes)
    n = blocks.shape[0]
    out = torch.empty(n * block, dtype=torch.float32, device=data.device)
    for start in range(0, n, _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, n)
        out[start * block : stop * block] = fn(blocks[start:stop]).reshape(-1)
    return out.reshape(shape)
