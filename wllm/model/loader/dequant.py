"""Pure-PyTorch dequantization of GGML/GGUF tensor data.

Every function here takes the raw bytes of a GGUF tensor (a uint8 torch tensor, on any device)
and returns float32 values in the tensor's logical shape. The results are bit-exact against
`gguf.quants.dequantize` (llama.cpp's Python reference): the same float32 operations are done in
the same order (scale products first, then `d * q - m`), each rounded on its own. That makes this
module the oracle for future CUDA dequant-GEMM kernels, so it stays in plain torch ops.

Block layouts (bytes per block, values per block) follow ggml-common.h:
Q4_0 (18, 32), Q4_1 (20, 32), Q5_0 (22, 32), Q5_1 (24, 32), Q8_0 (34, 32),
Q2_K (84, 256), Q3_K (110, 256), Q4_K (144, 256), Q5_K (176, 256), Q6_K (210, 256),
IQ4_NL (18, 32), IQ4_XS (136, 256).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from wllm.model.loader.errors import UnsupportedQuantTypeError

GGMLType = GGMLQuantizationType

# Blocks (of 32 values; a 256-value K-quant block counts as 8) dequantized per step on the CPU.
# Each step writes its float32 values in place into a slice of the output. 1000 blocks keep
# every op under ATen's 32768-element grain, so each runs on the calling thread: bigger ops
# open an OpenMP parallel region, and on a busy machine (more runnable threads than cores)
# every region waits for a descheduled worker, which makes the whole many times slower. The steps
# also keep their data in the CPU cache.
_CHUNK_BLOCKS = 1000
# On accelerators per-op launch cost dominates instead: big steps (scratch ~32 MB).
_DEVICE_CHUNK_BLOCKS = 1 << 18


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 field at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _f16_pair(blocks: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two consecutive fp16 fields (d, m) at byte `start`, as float32 [n, 1] each."""
    dm = blocks[:, start : start + 4].contiguous().view(torch.float16).to(torch.float32)
    return dm[:, 0:1], dm[:, 1:2]


def _shifts(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=like.device)


def _unpack(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., len(shifts), k]: field i of each byte is (byte >> shifts[i]) & mask."""
    s = _shifts(shifts, x).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _nibbles_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Write the low nibbles of bytes `x` [n, ..., k] to out[..., 0, :] and the high ones to
    out[..., 1, :] (out: float32 [n, ..., 2, k]); the uint8 -> float32 conversion is exact."""
    out.select(-2, 0).copy_(x & 0x0F)
    out.select(-2, 1).copy_(x >> 4)


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., 2, k]: low nibbles first, then high nibbles."""
    return _unpack(x, (0, 4), 0x0F)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """[n, ..., k] bytes -> [n, ..., 8, k]: bit 0 of each byte first."""
    return _unpack(x, range(8), 0x01)


# Each block function writes the float32 values of blocks `b` (uint8 [n, bytes per block]) into
# `out` (float32 [n, values per block]), in place. The float operations and their order are
# those of gguf.quants (scale products first, then `d * q` and `- m` / `+ m`, each rounded on
# its own), which is what keeps the results bit-exact; integers are exact in float32.


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    _nibbles_into(b[:, 2:18], out.view(n, 2, 16))
    out.sub_(8.0).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, m = _f16_pair(b, 0)
    _nibbles_into(b[:, 4:20], out.view(n, 2, 16))
    out.mul_(d).add_(m)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The 4 qh bytes as a little-endian uint32 bit field -> bit j for value j, as uint8 [n, 32]."""
    # Byte i holds bits 8i..8i+7: unpack to [n, bit, byte], then order byte-major.
    return _bits(qh).transpose(-1, -2).reshape(qh.shape[0], 32)


def _q5_values(b: torch.Tensor, qh_at: int, qs_at: int) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, qs_at : qs_at + 16]).reshape(n, 32)
    return ql | (_q5_high(b[:, qh_at : qh_at + 4]) << 4)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_values(b, 2, 6))
    out.sub_(16.0).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _f16_pair(b, 0)
    out.copy_(_q5_values(b, 4, 8))
    out.mul_(d).add_(m)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:34].view(torch.int8))
    out.mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # scales[16] | qs[64] | d | dmin
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16_pair(b, 80)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # Each 32-byte half holds 4 groups of 2-bit values (shifts 0, 2, 4, 6) of 32 values each.
    o = out.view(n, 16, 16)
    o.copy_(_unpack(b[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16))
    o.mul_(dl).sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
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
    o = out.view(n, 16, 16)
    o.copy_(ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8))
    o.mul_(dl)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte block of eight 6-bit scales and eight 6-bit mins used by Q4_K and Q5_K."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per-32-value scale `d * sc` and min `dmin * mn`, as float32 [n, 8, 1]."""
    n = b.shape[0]
    d, dmin = _f16_pair(b, 0)
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.to(torch.float32)).reshape(n, 8, 1), (dmin * mn.to(torch.float32)).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # d | dmin | scales[12] | qs[128]
    n = b.shape[0]
    dl, ml = _k_scales(b)
    # 4 groups of 32 bytes: low nibbles are values 64g..64g+31, high nibbles the next 32.
    _nibbles_into(b[:, 16:144].reshape(n, 4, 32), out.view(n, 4, 2, 32))
    o = out.view(n, 8, 32)
    o.mul_(dl).sub_(ml)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # d | dmin | scales[12] | qh[32] | qs[128]
    n = b.shape[0]
    dl, ml = _k_scales(b)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48]).reshape(n, 8, 32)
    o = out.view(n, 8, 32)
    o.copy_(ql | (qh << 4))
    o.mul_(dl).sub_(ml)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # ql[128] | qh[64] | scales[16] (int8) | d
    n = b.shape[0]
    sc = b[:, 192:208].view(torch.int8).to(torch.float32)
    dl = (_f16(b, 208) * sc).reshape(n, 16, 1)
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _unpack(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    o = out.view(n, 16, 16)
    o.copy_(((ql | (qh << 4)).view(torch.int8) - 32).view(n, 16, 16))
    o.mul_(dl)


# IQ4_NL / IQ4_XS: 4-bit indices into this non-linear table of int8 levels (ggml-common.h kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(q: torch.Tensor) -> torch.Tensor:
    """4-bit indices (uint8) -> their IQ4 levels, as float32 (exact)."""
    table = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)
    return table[q.long()]


def _iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    # d | qs[16]: low nibbles are values 0..15, high nibbles 16..31
    n = b.shape[0]
    out.copy_(_iq4_levels(_nibbles(b[:, 2:18]).reshape(n, 32)))
    out.mul_(_f16(b, 0))


def _iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    # d | scales_h (uint16: 2 bits per 32-value group) | scales_l[4] (a nibble per group) | qs[128]
    n = b.shape[0]
    low = _nibbles(b[:, 4:8]).transpose(-1, -2).reshape(n, 8)
    high_bits = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    high = ((high_bits >> shifts) & 0x03).to(torch.uint8)
    sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (_f16(b, 0) * sc).reshape(n, 8, 1)
    o = out.view(n, 8, 32)
    o.copy_(_iq4_levels(_nibbles(b[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)))
    o.mul_(dl)


_BLOCK_DEQUANT: dict[GGMLType, Callable[[torch.Tensor, torch.Tensor], None]] = {
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
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
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


def dequantize(
    data: torch.Tensor,
    t: int | GGMLType,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize raw GGUF bytes to a tensor of the logical `shape` on `data`'s device.

    `data` is a uint8 tensor holding exactly the tensor's blocks in file order (any shape; it is
    flattened). `shape` is in PyTorch/HF order (row-major, last dimension contiguous), i.e. the
    reverse of the GGUF `ne` order. Values are always computed in float32 (bit-exact against
    gguf.quants) and then cast to `dtype`, one chunk at a time, so a float16/bfloat16 result
    never needs a whole float32 copy. `out`, if given, is a contiguous tensor of `shape` (any
    floating dtype, `data`'s device) that receives the values and is returned; `dtype` is then
    ignored. Raises UnsupportedQuantTypeError for types not in SUPPORTED_TYPES and ValueError
    when the byte count does not match the shape.
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
    if out is not None:
        if tuple(out.shape) != shape or not out.is_contiguous() or not out.is_floating_point():
            raise ValueError(
                f"out must be a contiguous floating tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
            )
        if out.device != data.device:
            raise ValueError(f"out is on {out.device} but the bytes are on {data.device}")
        dtype = out.dtype
    flat = data.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if gt in _FLOAT_DTYPES:
        # A copy: the result must never alias the (possibly memory-mapped, read-only) source bytes.
        values = flat.view(_FLOAT_DTYPES[gt]).to(torch.float32, copy=True).reshape(shape)
        if out is not None:
            return out.copy_(values)
        return values if dtype == torch.float32 else values.to(dtype)
    block, nbytes = GGML_QUANT_SIZES[gt]
    fn = _BLOCK_DEQUANT[gt]
    blocks = flat.view(-1, nbytes)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    dst = out.view(n, block)
    step = max(1, (_CHUNK_BLOCKS if data.device.type == "cpu" else _DEVICE_CHUNK_BLOCKS) * 32 // block)
    # Another dtype: each chunk goes through a float32 scratch buffer, then is cast into place.
    scratch = None if dtype == torch.float32 else torch.empty(min(n, step), block, device=data.device)
    for start in range(0, n, step):
        stop = min(start + step, n)
        if scratch is None:
            fn(blocks[start:stop], dst[start:stop])
        else:
            tmp = scratch[: stop - start]
            fn(blocks[start:stop], tmp)
            dst[start:stop].copy_(tmp)
    return out
