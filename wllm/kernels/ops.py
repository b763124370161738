"""Kernel entry points for model code: CUDA library on GPU tensors, PyTorch reference elsewhere.

Each kernel is also registered as a `torch.library.custom_op` (namespace `wllm`) with a fake
implementation, so torch.compile and graph capture can trace through it. Eager calls on CUDA take
the raw ctypes binding directly: the custom-op dispatcher costs host time on every call, and the
decode loop is host-bound on small models.
"""

from __future__ import annotations

import ctypes

import torch

from wllm.kernels import _lib, reference

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

try:  # torch >= 2.3
    from torch.compiler import is_compiling as _is_compiling
except ImportError:  # pragma: no cover
    def _is_compiling() -> bool:
        return False


def _dtype_code(t: torch.Tensor, what: str) -> int:
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"{what}: unsupported dtype {t.dtype}; supported: float32, float16, bfloat16")
    return code


def _check_same(what: str, ref: torch.Tensor, *others: torch.Tensor) -> None:
    for other in others:
        if other.dtype != ref.dtype or other.device != ref.device:
            raise ValueError(f"{what}: tensors must share dtype and device, got {ref.dtype}@{ref.device} "
                             f"and {other.dtype}@{other.device}")


def _rows(t: torch.Tensor, hidden: int, what: str) -> torch.Tensor:
    """A [rows, hidden] view of t whose last dimension is contiguous (no copy)."""
    if t.shape[-1] != hidden:
        raise ValueError(f"{what}: last dimension {t.shape[-1]} does not match weight size {hidden}")
    if t.stride(-1) != 1:
        raise ValueError(f"{what}: the last dimension must be contiguous")
    try:
        return t.view(-1, hidden)
    except RuntimeError as exc:
        raise ValueError(f"{what}: tensor of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed "
                         "as rows; make it contiguous") from exc


def persistent_workspace(cache: dict[int, torch.Tensor], device: torch.device, lib: _lib.Binding,
                         size_function: str) -> torch.Tensor | None:
    """A zeroed uint8 workspace for `device` of the bytes the library's `size_function` reports, made on
    first use and kept in `cache`: kernels that take such a workspace leave it zeroed, so one allocation
    serves every later call and graph replay. None while a CUDA graph is being captured without one (an
    allocation then would belong to the graph's private pool); those kernels then run without it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    workspace = cache.get(index)
    if workspace is None and not torch.cuda.is_current_stream_capturing():
        size = ctypes.c_int64(0)
        with torch.cuda.device(index):  # sizes may depend on the device (its SM count)
            lib.check(getattr(lib, size_function)(ctypes.byref(size)), size_function.removeprefix("wllm_"))
        workspace = torch.zeros(size.value, dtype=torch.uint8, device=device)
        cache[index] = workspace
    return workspace


# CUDA builds of torch: the current stream's handle as an int, without building a Stream object (the public
# path costs a few microseconds, and an eager Llama-3.1-8B forward asks ~160 times).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(index: int) -> int:
    """The handle of the current CUDA stream of device `index` (a capture's stream while capturing)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _stream(t: torch.Tensor) -> int:
    return _stream_of(t.get_device())


# ---------------------------------------------------------------------------------------------
# CUDA paths (raw bindings)
# ---------------------------------------------------------------------------------------------


def _cuda_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    _check_same("rms_norm", x, weight)
    code = _dtype_code(x, "rms_norm")
    hidden = weight.numel()
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, hidden) if x.shape[-1] == hidden else _rows(x, hidden, "rms_norm")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_rms_norm(out.data_ptr(), x2.data_ptr(), weight.contiguous().data_ptr(), x2.shape[0],
                                hidden, hidden, x2.stride(0), eps, weight_offset, code, _stream(x)),
              "rms_norm")
    return out


def _cuda_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             weight_offset: float) -> None:
    _check_same("fused_add_rms_norm", x, residual, weight)
    code = _dtype_code(x, "fused_add_rms_norm")
    hidden = weight.numel()
    x2 = _rows(x, hidden, "fused_add_rms_norm x")
    r2 = _rows(residual, hidden, "fused_add_rms_norm residual")
    if x2.shape != r2.shape:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_fused_add_rms_norm(x2.data_ptr(), r2.data_ptr(), weight.contiguous().data_ptr(),
                                          x2.shape[0], hidden, x2.stride(0), r2.stride(0), eps, weight_offset,
                                          code, _stream(x)),
              "fused_add_rms_norm")


def _heads(t: torch.Tensor, head_size: int, what: str) -> tuple[int, int]:
    """(num_heads, token stride) of a [T, H*D] or [T, H, D] tensor with contiguous heads."""
    if t.dim() not in (2, 3) or t.stride(-1) != 1:
        raise ValueError(f"rotary_embedding: {what} must be [T, H*D] or [T, H, D] with a contiguous last dim")
    if t.dim() == 3 and t.stride(1) != head_size:
        raise ValueError(f"rotary_embedding: heads of {what} must be contiguous within a token")
    per_token = t.shape[1] * (t.shape[2] if t.dim() == 3 else 1)
    if per_token % head_size:
        raise ValueError(f"rotary_embedding: {what} width {per_token} is not a multiple of head_size {head_size}")
    return per_token // head_size, t.stride(0)


def _cuda_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
                 cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    if k is not None:
        _check_same("rotary_embedding", q, k)
    code = _dtype_code(q, "rotary_embedding")
    if positions.dtype != torch.int64 or cos_sin_cache.dtype != torch.float32:
        raise TypeError("rotary_embedding: positions must be int64 and cos_sin_cache float32")
    if positions.numel() != q.shape[0] or (k is not None and k.shape[0] != q.shape[0]):
        raise ValueError("rotary_embedding: positions, q and k must have the same number of tokens")
    num_heads, q_stride = _heads(q, head_size, "q")
    num_kv_heads, k_stride = _heads(k, head_size, "k") if k is not None else (0, 0)
    cache = cos_sin_cache.contiguous()
    lib = _lib.binding(q.device.index or 0)
    lib.check(lib.wllm_rotary_embedding(positions.contiguous().data_ptr(), q.data_ptr(),
                                        k.data_ptr() if k is not None else None, cache.data_ptr(),
                                        q.shape[0], num_heads, num_kv_heads, head_size, cache.shape[1],
                                        q_stride, k_stride, cache.shape[0], int(is_neox), code, _stream(q)),
              "rotary_embedding")


# ---------------------------------------------------------------------------------------------
# Custom ops (for torch.compile / tracing) and the public functions
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("wllm::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    if x.is_cuda:
        return _cuda_rms_norm(x, weight, eps, weight_offset)
    return reference.rms_norm(x, weight, eps, weight_offset)


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("wllm::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          weight_offset: float) -> None:
    if x.is_cuda:
        _cuda_fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    else:
        reference.fused_add_rms_norm(x, residual, weight, eps, weight_offset)


@fused_add_rms_norm_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> None:
    return None


@torch.library.custom_op("wllm::rotary_embedding", mutates_args=("q", "k"))
def rotary_embedding_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
                        cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    if q.is_cuda:
        _cuda_rotary(positions, q, k, head_size, cos_sin_cache, is_neox)
    else:
        reference.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)


@rotary_embedding_op.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
      cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim: x / rms(x) * (weight + weight_offset) (Gemma uses offset 1)."""
    if not x.is_cuda:
        return reference.rms_norm(x, weight, eps, weight_offset)
    if _is_compiling():
        return rms_norm_op(x, weight, eps, weight_offset)
    return _cuda_rms_norm(x, weight, eps, weight_offset)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0) -> None:
    """In place: residual += x (rounded to dtype), then x = rms_norm(residual)."""
    if not x.is_cuda:
        reference.fused_add_rms_norm(x, residual, weight, eps, weight_offset)
    elif _is_compiling():
        fused_add_rms_norm_op(x, residual, weight, eps, weight_offset)
    else:
        _cuda_fused_add_rms_norm(x, residual, weight, eps, weight_offset)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """In-place rotary embedding of q and k ([T, H*D] or [T, H, D]); see reference.rotary_embedding."""
    if not q.is_cuda:
        reference.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    elif _is_compiling():
        rotary_embedding_op(positions, q, k, head_size, cos_sin_cache, is_neox)
    else:
        _cuda_rotary(positions, q, k, head_size, cos_sin_cache, is_neox)


# ---------------------------------------------------------------------------------------------
# Paged prefill attention
# ---------------------------------------------------------------------------------------------

PREFILL_HEAD_SIZES = (64, 80, 96, 128, 256)


def _check_prefill_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    what = "paged_prefill_attention"
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{what}: expected q [T, Hq, D] and k/v caches [num_blocks, block_size, Hkv, D], got "
                         f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_size or num_heads % num_kv_heads:
        raise ValueError(f"{what}: q has {num_heads} heads of {head_size}, the cache {num_kv_heads} heads of "
                         f"{k_cache.shape[3]}; head sizes must match and query heads be a multiple of KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"{what}: block size {block_size} is not a power of two")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise TypeError(f"{what}: {name} must be int32, got {t.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"{what}: expected block_tables [S, max_blocks], seq_lens [S] and query_start_loc [S + 1], "
                         f"got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"{what}: q and the KV cache must share a dtype, got {q.dtype} and {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != q.device:
            raise ValueError(f"{what}: {name} is on {t.device} but q on {q.device}")


def _cuda_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                  scale: float, sliding_window: int, logit_softcap: float,
                                  out: torch.Tensor | None = None) -> torch.Tensor:
    what = "paged_prefill_attention"
    _check_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    code = _dtype_code(q, what)
    head_size = q.shape[2]
    if head_size not in PREFILL_HEAD_SIZES:
        raise ValueError(f"{what}: head size {head_size} has no CUDA kernel (supported: {PREFILL_HEAD_SIZES})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"{what}: k and v caches must share strides and have contiguous head dims")
    if q.stride(-1) != 1 or (q.element_size() == 2 and (q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8)):
        q = q.contiguous()  # the tensor-core kernel reads 16-byte rows
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"{what}: out must be {tuple(q.shape)} {q.dtype} with contiguous head dims")
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lib = _lib.binding(q.device.index or 0)
    lib.check(lib.wllm_paged_prefill_attention(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
        seq_lens.contiguous().data_ptr(), query_start_loc.contiguous().data_ptr(), q.shape[0], seq_lens.shape[0],
        q.shape[1], k_cache.shape[2], head_size, k_cache.shape[1], bt.stride(0), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale,
        sliding_window, logit_softcap, code, _stream(q)), what)
    return out


@torch.library.custom_op("wllm::paged_prefill_attention", mutates_args=())
def paged_prefill_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                               scale: float, sliding_window: int, logit_softcap: float) -> torch.Tensor:
    if q.is_cuda:
        return _cuda_paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             sliding_window, logit_softcap)
    return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             sliding_window, logit_softcap)


@paged_prefill_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int,
      logit_softcap: float) -> torch.Tensor:
    return q.new_empty(q.shape)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a batch's new tokens (prefill chunks, prefix-cache hits, several tokens
    per request) over a paged KV cache whose K/V already hold those tokens.

    q [T, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D] (one layer's views, any
    block/token/head strides); block_tables int32 [S, max_blocks]; seq_lens int32 [S] (context
    length including the new tokens); query_start_loc int32 [S + 1]. Query i of sequence s sits at
    position seq_lens[s] - q_len + i. sliding_window: keys within that many positions (None: all);
    logit_softcap: cap * tanh(score / cap) (None: off). Returns [T, Hq, D], written into `out` when given,
    where rows outside [query_start_loc[0], query_start_loc[-1]) keep what they held (the queries of other
    sequences, e.g. a mixed step's decode rows); in a fresh result those rows are undefined on CUDA. See
    reference.paged_prefill_attention.
    """
    window = int(sliding_window or 0)
    cap = float(logit_softcap or 0.0)
    if window < 0 or cap < 0:
        raise ValueError(f"paged_prefill_attention: sliding_window {sliding_window} and logit_softcap "
                         f"{logit_softcap} must be positive or None")
    if not 0.0 < scale < float("inf"):  # the CUDA kernel's softmax folds the scale into exp2 (max needs > 0)
        raise ValueError(f"paged_prefill_attention: scale must be a positive finite number, got {scale}")
    if not q.is_cuda:
        _check_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
        result = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                   scale, window, cap)
        if out is not None:  # the rows the kernel writes, no others
            lo, hi = int(query_start_loc[0]), int(query_start_loc[-1])
            out[lo:hi].copy_(result[lo:hi])
            return out
    elif _is_compiling():
        result = paged_prefill_attention_op(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                            window, cap)
    else:
        return _cuda_paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                             window, cap, out)
    if out is not None:
        out.copy_(result)
        return out
    return result


# ---------------------------------------------------------------------------------------------
# Decode path: KV write, block copy, decode attention, gated activation, sampling
# ---------------------------------------------------------------------------------------------

DECODE_HEAD_SIZES = (64, 80, 96, 128, 256)
_ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}


def _kv_view(t: torch.Tensor, cache: torch.Tensor, what: str) -> torch.Tensor:
    """[T, Hkv, D] view of new keys/values given as [T, Hkv, D] or [T, Hkv * D]."""
    if t.dim() == 2:
        t = t.unflatten(-1, (cache.shape[2], cache.shape[3]))
    if t.dim() != 3 or t.shape[1:] != cache.shape[2:] or t.stride(-1) != 1:
        raise ValueError(f"reshape_and_cache: {what} {tuple(t.shape)} does not match the cache's heads "
                         f"{tuple(cache.shape[2:])} (or its last dim is not contiguous)")
    return t


def _cuda_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    what = "reshape_and_cache"
    _check_same(what, key_cache, key, value, value_cache)
    code = _dtype_code(key_cache, what)
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(f"{what}: caches must both be [num_blocks, block_size, Hkv, D] with the same strides")
    key, value = _kv_view(key, key_cache, "key"), _kv_view(value, key_cache, "value")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],) or value.shape != key.shape:
        raise ValueError(f"{what}: slot_mapping must be int64 [{key.shape[0]}] and key/value the same shape")
    lib = _lib.binding(key.device.index or 0)
    lib.check(lib.wllm_reshape_and_cache(
        key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slot_mapping.contiguous().data_ptr(), key.shape[0], key_cache.shape[2], key_cache.shape[3],
        key_cache.shape[1], key_cache.shape[0], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), code, _stream(key)), what)


def _planes(t: torch.Tensor, block_dim: int, what: str) -> tuple[int, int, int, int]:
    """(planes, plane stride, block stride, block bytes) of a cache whose dims before block_dim
    collapse into one strided dimension and whose dims after it are contiguous."""
    esize = t.element_size()
    inner = 1
    for d in range(t.dim() - 1, block_dim, -1):
        if t.stride(d) != inner:
            raise ValueError(f"copy_blocks: {what} blocks are not contiguous (strides {t.stride()})")
        inner *= t.shape[d]
    planes = 1
    for d in range(block_dim - 1, -1, -1):
        if d < block_dim - 1 and t.stride(d) != t.stride(d + 1) * t.shape[d + 1]:
            raise ValueError(f"copy_blocks: the leading dims of {what} do not collapse (strides {t.stride()})")
        planes *= t.shape[d]
    plane_stride = t.stride(block_dim - 1) if block_dim else t.shape[block_dim] * t.stride(block_dim)
    return planes, plane_stride * esize, t.stride(block_dim) * esize, inner * esize


def _cuda_copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int) -> None:
    what = "copy_blocks"
    if src.dtype != dst.dtype or src.shape[:block_dim] != dst.shape[:block_dim] or \
            src.shape[block_dim + 1:] != dst.shape[block_dim + 1:]:
        raise ValueError(f"{what}: caches differ: {src.dtype} {tuple(src.shape)} vs {dst.dtype} {tuple(dst.shape)}")
    planes, src_plane, src_block, block_bytes = _planes(src, block_dim, "src")
    _, dst_plane, dst_block, _ = _planes(dst, block_dim, "dst")
    host_pairs = pairs.to("cpu", torch.int64).contiguous()
    device = src.device if src.is_cuda else dst.device
    lib = _lib.binding(device.index or 0)
    lib.check(lib.wllm_copy_blocks(src.data_ptr(), dst.data_ptr(), host_pairs.data_ptr(), host_pairs.shape[0],
                                   planes, block_bytes, src.shape[block_dim], dst.shape[block_dim], src_block,
                                   dst_block, src_plane, dst_plane, _stream_of(device.index or 0)),
              what)


def decode_workspace_size(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
                          num_splits: int = 0, device: int = 0) -> int:
    """Bytes of fp32 workspace paged_decode_attention needs for these sizes (0: it will not split).
    Allocate it zero-filled (torch.zeros): its first bytes hold the split-merge tickets."""
    size = _lib.c_int64(0)
    lib = _lib.binding(device)
    lib.check(lib.wllm_paged_decode_workspace_size(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len,
                                                   num_splits, _lib.ctypes.byref(size)), "paged_decode_workspace_size")
    return size.value


def _check_decode_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    what = "paged_decode_attention"
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{what}: expected q [S, Hq, D] and caches [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if key_cache.shape[3] != q.shape[2] or q.shape[1] % key_cache.shape[2]:
        raise ValueError(f"{what}: q has {q.shape[1]} heads of {q.shape[2]}, the cache {key_cache.shape[2]} of "
                         f"{key_cache.shape[3]}; head sizes must match and Hq be a multiple of Hkv")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.dim() != 2 or \
            seq_lens.shape != (q.shape[0],) or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"{what}: expected block_tables int32 [S, max_blocks] and seq_lens int32 [S] for S = "
                         f"{q.shape[0]}, got {block_tables.dtype} {tuple(block_tables.shape)} and {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if q.dtype != key_cache.dtype or q.dtype != value_cache.dtype:
        raise ValueError(f"{what}: q and the caches must share a dtype, got {q.dtype} and {key_cache.dtype}")


def _cuda_paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                                 sliding_window: int, logit_softcap: float, num_splits: int,
                                 out: torch.Tensor | None = None,
                                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    what = "paged_decode_attention"
    _check_decode_args(q, key_cache, value_cache, block_tables, seq_lens)
    code = _dtype_code(q, what)
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError(f"{what}: k and v caches must share strides and have contiguous head dims")
    vec = 16 // q.element_size()
    if q.stride(-1) != 1 or q.data_ptr() % 16 or q.stride(0) % vec or q.stride(1) % vec:
        q = q.contiguous()
    num_seqs, num_heads, head_size = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"{what}: out must be {tuple(q.shape)} {q.dtype} with contiguous head dims")
    device = q.device.index or 0
    need = decode_workspace_size(num_seqs, num_heads, key_cache.shape[2], head_size, max_seq_len, num_splits, device)
    if need and workspace is None:
        # Zeroed: the fused split merge keeps its tickets there (each call leaves them zero).
        workspace = torch.zeros((need + 3) // 4, dtype=torch.float32, device=q.device)
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lib = _lib.binding(device)
    lib.check(lib.wllm_paged_decode_attention(
        out.data_ptr(), q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), bt.data_ptr(),
        seq_lens.contiguous().data_ptr(), num_seqs, num_heads, key_cache.shape[2], head_size, key_cache.shape[1],
        max_seq_len, bt.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1), key_cache.stride(0),
        key_cache.stride(1), key_cache.stride(2), scale, sliding_window, logit_softcap, num_splits,
        workspace.data_ptr() if workspace is not None else None,
        workspace.numel() * workspace.element_size() if workspace is not None else 0, code, _stream(q)), what)
    return out


def _cuda_act_and_mul(x: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    what = "act_and_mul"
    code = _dtype_code(x, what)
    if activation not in _ACTIVATION_CODES or x.shape[-1] % 2:
        raise ValueError(f"{what}: activation {activation!r} (supported: silu, gelu_tanh) on an even last dim, "
                         f"got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = _rows(x, 2 * inter, what)
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    o2 = _rows(out, inter, what + " out")
    lib = _lib.binding(x.device.index or 0)
    lib.check(lib.wllm_act_and_mul(o2.data_ptr(), x2.data_ptr(), x2.shape[0], inter, o2.stride(0), x2.stride(0),
                                   _ACTIVATION_CODES[activation], code, _stream(x)), what)
    return out


@torch.library.custom_op("wllm::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache_op(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@reshape_and_cache_op.register_fake
def _(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
      slot_mapping: torch.Tensor) -> None:
    return None


@torch.library.custom_op("wllm::copy_blocks", mutates_args=("dst",))
def copy_blocks_op(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int) -> None:
    copy_blocks(src, dst, pairs, block_dim)


@copy_blocks_op.register_fake
def _(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int) -> None:
    return None


@torch.library.custom_op("wllm::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                              sliding_window: int, logit_softcap: float, num_splits: int) -> torch.Tensor:
    if q.is_cuda:
        return _cuda_paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                            sliding_window, logit_softcap, num_splits)
    return reference.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                            logit_softcap)


@paged_decode_attention_op.register_fake
def _(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
      seq_lens: torch.Tensor, scale: float, max_seq_len: int, sliding_window: int, logit_softcap: float,
      num_splits: int) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("wllm::act_and_mul", mutates_args=())
def act_and_mul_op(x: torch.Tensor, activation: str) -> torch.Tensor:
    return _cuda_act_and_mul(x, activation) if x.is_cuda else reference.act_and_mul(x, activation)


@act_and_mul_op.register_fake
def _(x: torch.Tensor, activation: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new key/value ([T, Hkv, D] or [T, Hkv * D]) into one layer's caches [num_blocks,
    block_size, Hkv, D] at slot_mapping (int64 [T], block * block_size + offset; -1 is skipped)."""
    if not key_cache.is_cuda:
        reference.reshape_and_cache(key.reshape(key.shape[0], *key_cache.shape[2:]),
                                    value.reshape(value.shape[0], *key_cache.shape[2:]), key_cache, value_cache,
                                    slot_mapping)
    elif _is_compiling():
        reshape_and_cache_op(key, value, key_cache, value_cache, slot_mapping)
    else:
        _cuda_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int = 2) -> None:
    """Copy whole blocks from src to dst (same or different caches, GPU or pinned CPU) along block_dim
    (2 for the engine's [layers, 2, num_blocks, ...] cache): dst[..., d, ...] = src[..., s, ...] for
    every (s, d) row of pairs (int64 [N, 2]). On CUDA this is one batched, asynchronous call on the
    current stream: synchronise before reading a CPU destination."""
    pairs = torch.as_tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    if not (src.is_cuda or dst.is_cuda):
        reference.copy_blocks(src, dst, pairs, block_dim)
    elif _is_compiling():
        copy_blocks_op(src, dst, pairs, block_dim)
    else:
        _cuda_copy_blocks(src, dst, pairs, block_dim)


def host_mapped(t: torch.Tensor) -> bool:
    """Whether kernels can read and write the CPU tensor `t` in place (pinned memory under unified
    addressing), so `stage_copy` may move it without the copy engine. False off CUDA."""
    if t.is_cuda or not t.is_pinned() or not _lib.available():
        return False
    return bool(_lib.binding(torch.cuda.current_device()).wllm_host_mapped(t.data_ptr()))


_PREV_DTYPES = {torch.int64: 1, torch.float64: 2}


def stage_copy(dst: torch.Tensor, src: torch.Tensor, input_ids: torch.Tensor | None = None,
               prev_tokens: torch.Tensor | None = None, pairs: torch.Tensor | None = None, n: int = 0) -> None:
    """A decode step's staging in one small kernel on the current stream: dst's bytes = src's bytes (one of
    them may be pinned host memory that `host_mapped` accepts: the kernel reads or writes it in place,
    no copy-engine transfer), then input_ids[pairs[i]] = prev_tokens[pairs[n + i]] for i < n (token index,
    then the previous step's row; (i, i) when pairs is None), prev_tokens being the int64 or float64
    token ids of the previous step on the device and pairs int64 (it may lie inside dst). Meant for a few
    KB. Off CUDA it is `reference.stage_copy`. Raises ValueError on mismatched sizes or dtypes."""
    if dst.numel() * dst.element_size() != src.numel() * src.element_size():
        raise ValueError(f"stage_copy: dst has {dst.numel() * dst.element_size()} bytes, src "
                         f"{src.numel() * src.element_size()}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("stage_copy: dst and src must be contiguous")
    if n:
        if input_ids is None or prev_tokens is None or input_ids.dtype != torch.int64 or \
                prev_tokens.dtype not in _PREV_DTYPES or \
                (pairs is None and (input_ids.numel() < n or prev_tokens.numel() < n)) or \
                (pairs is not None and (pairs.dtype != torch.int64 or pairs.numel() < 2 * n)):
            raise ValueError("stage_copy: n > 0 needs int64 input_ids, int64/float64 prev_tokens and int64 pairs "
                             "with at least n elements (2 * n pairs)")
        if not (input_ids.is_contiguous() and prev_tokens.is_contiguous()):
            raise ValueError("stage_copy: input_ids and prev_tokens must be contiguous")
    device = dst.device if dst.is_cuda else src.device
    if device.type != "cuda":
        reference.stage_copy(dst, src, input_ids, prev_tokens, pairs, n)
        return
    lib = _lib.binding(device.index or 0)
    lib.check(lib.wllm_stage_copy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(),
                                  input_ids.data_ptr() if n else None, prev_tokens.data_ptr() if n else None,
                                  _PREV_DTYPES[prev_tokens.dtype] if n else 0,
                                  pairs.data_ptr() if n and pairs is not None else None, n,
                                  _stream_of(device.index or 0)),
              "stage_copy")


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           max_seq_len: int | None = None, sliding_window: int | None = None,
                           logit_softcap: float | None = None, num_splits: int = 0, out: torch.Tensor | None = None,
                           workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over a paged KV cache (see reference.paged_decode_attention).

    q [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [S, max_blocks]; seq_lens
    int32 [S] (0 = padding row -> zeros). max_seq_len bounds seq_lens on the host (default: the block
    table's capacity) and sizes the split-KV grid; keep it fixed across CUDA-graph replays. num_splits
    0 chooses the split automatically. workspace: fp32 of decode_workspace_size(...) bytes, 16-byte
    aligned (any fresh torch allocation is) and zero-filled before its first use (allocated when None);
    every call leaves its ticket counters zero again, so one zeroed workspace serves any number of calls,
    CUDA-graph replays included, on one stream at a time.
    """
    window, cap = int(sliding_window or 0), float(logit_softcap or 0.0)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * key_cache.shape[1]
    if not q.is_cuda:
        _check_decode_args(q, key_cache, value_cache, block_tables, seq_lens)
        result = reference.paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window, cap)
    elif _is_compiling():
        result = paged_decode_attention_op(q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                           window, cap, num_splits)
    else:
        return _cuda_paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                            window, cap, num_splits, out, workspace)
    if out is not None:
        out.copy_(result)
        return out
    return result


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for x = [gate | up] on the last dim; activation "silu" or "gelu_tanh"."""
    if not x.is_cuda:
        return reference.act_and_mul(x, activation)
    if _is_compiling():
        return act_and_mul_op(x, activation)
    return _cuda_act_and_mul(x, activation)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (Llama, Qwen, Mistral MLPs)."""
    return act_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(gate) * up (Gemma MLPs)."""
    return act_and_mul(x, "gelu_tanh")


# ---------------------------------------------------------------------------------------------
# Rotary embedding fused with the KV-cache write
# ---------------------------------------------------------------------------------------------


def _head_view(t: torch.Tensor, head_size: int, what: str) -> torch.Tensor:
    """[T, H, D] view (no copy) of a [T, H, D] or [T, H * D] tensor with a contiguous last dim."""
    if t.dim() == 2 and t.shape[1] % head_size == 0:
        t = t.unflatten(-1, (-1, head_size))
    if t.dim() != 3 or t.shape[2] != head_size or t.stride(-1) != 1:
        raise ValueError(f"rotary_and_cache: {what} {tuple(t.shape)} is not [T, H, {head_size}] or "
                         f"[T, H * {head_size}] with a contiguous last dim")
    return t


def _cuda_rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    what = "rotary_and_cache"
    _check_same(what, key_cache, q, k, v, value_cache)
    code = _dtype_code(key_cache, what)
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(f"{what}: caches must both be [num_blocks, block_size, Hkv, D] with the same strides")
    if key_cache.stride(-1) != 1:
        raise ValueError(f"{what}: the caches' head dims must be contiguous")
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    q3, k3, v3 = _head_view(q, head_size, "q"), _head_view(k, head_size, "k"), _head_view(v, head_size, "v")
    num_tokens = q3.shape[0]
    if k3.shape != (num_tokens, num_kv_heads, head_size) or v3.shape != k3.shape:
        raise ValueError(f"{what}: k {tuple(k3.shape)} and v {tuple(v3.shape)} must be [{num_tokens}, "
                         f"{num_kv_heads}, {head_size}] to match q and the cache")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise TypeError(f"{what}: positions and slot_mapping must be int64")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"{what}: positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must be [{num_tokens}]")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] > head_size:
        raise ValueError(f"{what}: cos_sin_cache must be float32 [max_position, rot_dim <= {head_size}]")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"{what}: {name} is on {t.device} but q on {q.device}")
    table = cos_sin_cache.contiguous()
    lib = _lib.binding(q.device.index or 0)
    lib.check(lib.wllm_rotary_and_cache(
        positions.contiguous().data_ptr(), q3.data_ptr(), k3.data_ptr(), v3.data_ptr(), key_cache.data_ptr(),
        value_cache.data_ptr(), slot_mapping.contiguous().data_ptr(), table.data_ptr(), num_tokens, q3.shape[1],
        num_kv_heads, head_size, table.shape[1], block_size, num_blocks, table.shape[0], q3.stride(0), q3.stride(1),
        k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), int(is_neox), code, _stream(q)), what)


@torch.library.custom_op("wllm::rotary_and_cache", mutates_args=("q", "key_cache", "value_cache"))
def rotary_and_cache_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    if q.is_cuda:
        _cuda_rotary_and_cache(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)
    else:
        reference.rotary_and_cache(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)


@rotary_and_cache_op.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
      value_cache: torch.Tensor, slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    return None


def rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """rotary_embedding + reshape_and_cache in one kernel: q ([T, Hq, D] or [T, Hq * D]) is rotated in
    place; k and v ([T, Hkv, D] or [T, Hkv * D], any token/head strides, e.g. views of a fused qkv
    output) go into one layer's caches [num_blocks, block_size, Hkv, D] at slot_mapping (int64 [T];
    -1 is skipped), k rotated on the way. k itself is not modified: read rotated keys from the cache.
    cos_sin_cache is the fp32 [max_position, rot_dim] table of rotary_embedding (rot_dim <= D)."""
    if not q.is_cuda:
        reference.rotary_and_cache(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)
    elif _is_compiling():
        rotary_and_cache_op(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)
    else:
        _cuda_rotary_and_cache(positions, q, k, v, key_cache, value_cache, slot_mapping, cos_sin_cache, is_neox)
