"""Pure-PyTorch references for every kernel: the CPU path and the oracle in tests.

Each computes in float32 and rounds once to the input dtype, exactly as the CUDA kernel does.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * (weight.float() + weight_offset)).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_offset: float = 0.0) -> None:
    # The sum is rounded to the dtype before the norm, as an unfused `x + residual` would be.
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    x.copy_(rms_norm(residual, weight, eps, weight_offset))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """In place on q [T, H*D] or [T, H, D] (and k); only the first rot_dim dims of a head rotate."""
    rot_dim = cos_sin_cache.shape[-1]
    half = rot_dim // 2
    cs = cos_sin_cache.index_select(0, positions.clamp(0, cos_sin_cache.shape[0] - 1)).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        if t is None:
            continue
        view = t.view(t.shape[0], -1, head_size)
        rot = view[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        view[..., :rot_dim] = out.to(t.dtype)


def rotary_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0,
                         inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [max_position, rot_dim] table: cos of each frequency in the first half, sin in the second.

    Computed in float32 the way HF transformers does, so positions map to bit-identical angles.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, sliding_window: int = 0, logit_softcap: float = 0.0) -> torch.Tensor:
    """Attention of variable-length query chunks over a paged KV cache (fp32 math, one rounding).

    q [T, Hq, D]: sequence s owns rows query_start_loc[s]:query_start_loc[s + 1] and has
    seq_lens[s] tokens of context, the new ones included, so its query i sits at position
    seq_lens[s] - q_len + i and sees keys at positions <= its own (and > position - sliding_window
    when sliding_window > 0). Key j of sequence s is k_cache[block_tables[s, j // bs], j % bs]
    with k_cache [num_blocks, bs, Hkv, D]. Scores are q.k * scale, soft-capped as
    cap * tanh(score / cap) when logit_softcap > 0. Rows past query_start_loc[-1] come back zero.
    """
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, ctx in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        n = hi - lo
        if n == 0:
            continue
        if n > ctx:
            raise ValueError(f"paged_prefill_attention: sequence {s} has {n} new tokens but seq_lens {ctx}")
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_size)[:ctx].float()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_size)[:ctx].float()
        qs = q[lo:hi].float().reshape(n, num_kv_heads, group, head_size)
        scores = torch.einsum("nhgd,chd->hgnc", qs, keys) * scale
        if logit_softcap > 0:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed = allowed & (k_pos > q_pos - sliding_window)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        o = torch.einsum("hgnc,chd->nhgd", probs, values)
        out[lo:hi] = o.reshape(n, num_heads, head_size).to(q.dtype)
    return out
