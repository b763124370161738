"""Kernel entry points for model code: CUDA library on GPU tensors, PyTorch reference elsewhere.

Each kernel is also registered as a `torch.library.custom_op` (namespace `wllm`) with a fake
implementation, so torch.compile and graph capture can trace through it. Eager calls on CUDA take
the raw ctypes binding directly: the custom-op dispatcher costs host time on every call, and the
decode loop is host-bound on small models.
"""

from __future__ import annotations

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


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


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
    logit_softcap: cap * tanh(score / cap) (None: off). Returns [T, Hq, D] (written into `out` when
    given); rows past query_start_loc[-1] are left unwritten on CUDA. See reference.paged_prefill_attention.
    """
    window = int(sliding_window or 0)
    cap = float(logit_softcap or 0.0)
    if window < 0 or cap < 0:
        raise ValueError(f"paged_prefill_attention: sliding_window {sliding_window} and logit_softcap "
                         f"{logit_softcap} must be positive or None")
    if not q.is_cuda:
        _check_prefill_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
        result = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                   scale, window, cap)
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
