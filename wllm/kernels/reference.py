"""Pure-PyTorch references for every kernel: the CPU path and the oracle in tests.

Each computes in float32 and rounds once to the input dtype, exactly as the CUDA kernel does.
"""

from __future__ import annotations

import math

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


# ---------------------------------------------------------------------------------------------
# Decode path: KV write, block copy, decode attention, gated activation, sampling
# ---------------------------------------------------------------------------------------------


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping[t]
    (= block * block_size + offset); negative or out-of-range slots are skipped."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_blocks * block_size)
    slots = slots[valid]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """rotary_embedding of q in place and of a copy of k, then reshape_and_cache of that rotated k
    and v; k itself is left unchanged. q [T, Hq, D] or [T, Hq * D], k/v [T, Hkv, D] or [T, Hkv * D]
    (any strides), caches [num_blocks, block_size, Hkv, D]."""
    num_tokens, head_size = q.shape[0], key_cache.shape[3]
    q_rot = q.reshape(num_tokens, -1, head_size).clone()
    k_rot = k.reshape(num_tokens, -1, head_size).clone()
    rotary_embedding(positions, q_rot, k_rot, head_size, cos_sin_cache, is_neox)
    q.copy_(q_rot.view(q.shape))
    reshape_and_cache(k_rot, v.reshape(num_tokens, -1, head_size), key_cache, value_cache, slot_mapping)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, block_dim: int = 2) -> None:
    """dst[..., d, ...] = src[..., s, ...] along block_dim for every (s, d) row of pairs [N, 2]."""
    if pairs.numel() == 0:
        return
    src_ids = pairs[:, 0].long().to(src.device)
    dst_ids = pairs[:, 1].long().to(dst.device)
    gathered = src.index_select(block_dim, src_ids).to(dst.device)
    dst.index_copy_(block_dim, dst_ids, gathered)


def stage_copy(dst: torch.Tensor, src: torch.Tensor, input_ids: torch.Tensor | None = None,
               prev_tokens: torch.Tensor | None = None, pairs: torch.Tensor | None = None, n: int = 0) -> None:
    """dst (bytes) = src (bytes); then input_ids[pairs[i]] = prev_tokens[pairs[n + i]] for i < n ((i, i)
    when pairs is None)."""
    dst.view(torch.uint8).copy_(src.view(torch.uint8))
    if n:
        if pairs is None:
            index = torch.arange(n, device=input_ids.device)
            rows = index.to(prev_tokens.device)
        else:
            flat = pairs.reshape(-1)
            index, rows = flat[:n].long().to(input_ids.device), flat[n:2 * n].long().to(prev_tokens.device)
        input_ids.index_copy_(0, index, prev_tokens.index_select(0, rows).to(input_ids.device, input_ids.dtype))


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int = 0,
                           logit_softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence over its paged K/V, in fp32; rows with seq_len 0 are zeros.

    q [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [S, max_blocks];
    seq_lens int32 [S] (context including the current token).
    """
    num_seqs, num_heads, head_size = q.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    lens = seq_lens.long().clamp(min=0)
    max_len = int(lens.max().item()) if num_seqs else 0
    out = torch.zeros(num_seqs, num_heads, value_cache.shape[-1], dtype=q.dtype, device=q.device)
    if max_len == 0:
        return out
    pos = torch.arange(max_len, device=q.device)
    table = block_tables.long()[:, (pos // block_size).clamp(max=block_tables.shape[1] - 1)]
    blocks = table.clamp(0, num_blocks - 1)  # entries past a sequence's length may be anything
    offsets = (pos % block_size).expand(num_seqs, -1)
    keys = key_cache[blocks, offsets].float()  # [S, L, Hkv, D]
    values = value_cache[blocks, offsets].float()
    group = num_heads // num_kv_heads
    qs = q.float().view(num_seqs, num_kv_heads, group, head_size)
    scores = torch.einsum("skgd,slkd->skgl", qs, keys) * scale
    if logit_softcap:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    allowed = pos[None, :] < lens[:, None]
    if sliding_window:
        allowed &= pos[None, :] >= (lens[:, None] - sliding_window)
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked (empty) rows -> zeros
    # The batch is padded to its longest sequence: a shorter one gathers slots it does not own, whose
    # values (a NaN or inf left in a reused block) must not meet its zero probabilities (0 * inf is NaN).
    values = values.masked_fill(~allowed[:, :, None, None], 0.0)
    o = torch.einsum("skgl,slkd->skgd", probs, values)
    return o.reshape(num_seqs, num_heads, -1).to(q.dtype)


ACTIVATIONS = ("silu", "gelu_tanh")


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(x[..., :I]) * x[..., I:] computed in fp32 and rounded once (x = [gate | up])."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].float(), x[..., inter:].float()
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    elif activation == "gelu_tanh":
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    else:
        raise ValueError(f"act_and_mul: unknown activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
    return (act * up).to(x.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None, output_activation: str | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) in fp32, rounded once to x's dtype; weight is [out, in] as nn.Linear stores it.

    With an activation ("silu" or "gelu_tanh"), x is [..., 2 * in] = [gate | up] and the input is
    act_and_mul(x), rounded to the dtype first as the unfused path (activation kernel, then matmul) rounds it.
    With an output_activation, weight is [gate rows | up rows] and the result is act_and_mul of the rounded
    product: [..., out / 2] (the gated MLP's gate_up projection and its activation in one).
    """
    if activation is not None:
        x = act_and_mul(x, activation)
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if output_activation is None else act_and_mul(y, output_activation)


_MASK32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a 32-bit constant and int64 tensor of 32-bit values."""
    p_lo = a * (b & 0xFFFF)  # < 2^48: exact in int64
    t = (p_lo >> 16) + a * (b >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(counter: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (the CUDA sampler's generator)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def gumbel_noise(vocab: int, seed: int, position: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """-log(E_i), E_i ~ Exp(1), for tokens 0..vocab-1: Philox keyed by seed, counted by (i / 4, position)."""
    groups = torch.arange((vocab + 3) // 4, dtype=torch.int64, device=device)
    seed &= (1 << 64) - 1
    position &= (1 << 64) - 1
    zeros = torch.zeros_like(groups)
    words = philox4x32([groups & _MASK32, groups >> 32, zeros + (position & _MASK32), zeros + (position >> 32)],
                       (seed & _MASK32, seed >> 32))
    return neg_log_exponential(torch.stack(words, dim=1).reshape(-1)[:vocab])


def neg_log_exponential(words: torch.Tensor) -> torch.Tensor:
    """-log(E), E ~ Exp(1), from 32-bit random words (int64 tensor): u = (top 23 bits + 1/2) / 2^23 is
    exact in fp32 and strictly inside (0, 1)."""
    u = ((words >> 9).float() + 0.5) * 1.1920928955078125e-07
    return -torch.log(-torch.log(u))


def _top_p_floor(x: torch.Tensor, keep: torch.Tensor, xmax: torch.Tensor, top_p: float) -> torch.Tensor:
    """Lowest kept value whose strictly-larger kept mass is below top_p of the kept mass (the CUDA
    kernel's integer mass units: floor(exp(x - max) * 2^32))."""
    vals = x[keep]
    weights = torch.floor(torch.exp(vals - xmax).double() * 4294967296.0).long()
    total = int(weights.sum().item())
    target = max(math.ceil(float(torch.tensor(top_p, dtype=torch.float32).item()) * float(total)), 1)
    if total < target:
        return vals.min()
    order = torch.argsort(vals, descending=True)
    above = torch.cumsum(weights[order], 0) - weights[order]
    last = int((above < target).nonzero().max().item())
    return vals[order[last]]


def sampling_mask(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Tokens that survive top-k, then top-p (over the top-k renormalised mass; ties with the last kept
    value are kept), then min-p, for one row of temperature-scaled logits x."""
    xmax = x.max()
    keep = torch.ones(x.shape[-1], dtype=torch.bool, device=x.device)
    if 0 < top_k < x.shape[-1]:
        keep &= x >= torch.topk(x, top_k).values[-1]
    if top_p < 1:
        keep &= x >= _top_p_floor(x, keep, xmax, top_p)
    if min_p > 0:
        keep &= torch.exp(x - xmax) >= min_p
    return keep


def sample(logits: torch.Tensor, params_f32: torch.Tensor, params_i64: torch.Tensor,
           bias_offsets: torch.Tensor | None = None, bias_tokens: torch.Tensor | None = None,
           bias_values: torch.Tensor | None = None, penalty_offsets: torch.Tensor | None = None,
           penalty_tokens: torch.Tensor | None = None, penalty_counts: torch.Tensor | None = None,
           return_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference of the CUDA sampler (see csrc/api.h, wllm_sample): (tokens int64 [S], raw logprob of
    each token fp32 [S], raw log-softmax [S, V] or None). logits are not modified."""
    num_rows, vocab = logits.shape
    raw_lp = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    pf, pi = params_f32.cpu().tolist(), params_i64.cpu().tolist()
    for r in range(num_rows):
        temperature, top_p, min_p, repetition, frequency, presence = (torch.tensor(v, dtype=torch.float32)
                                                                      for v in pf[r])
        top_k, seed, position = pi[r]
        x = logits[r].float().clone()
        if bias_offsets is not None:
            lo, hi = int(bias_offsets[r]), int(bias_offsets[r + 1])
            toks, vals = bias_tokens[lo:hi].long(), bias_values[lo:hi].float()
            ok = (toks >= 0) & (toks < vocab)
            x.index_add_(0, toks[ok], vals[ok])
        if penalty_offsets is not None and (repetition != 1 or frequency != 0 or presence != 0):
            lo, hi = int(penalty_offsets[r]), int(penalty_offsets[r + 1])
            toks, counts = penalty_tokens[lo:hi].long(), penalty_counts[lo:hi]
            ok = (toks >= 0) & (toks < vocab)
            toks, counts = toks[ok], counts[ok]
            v = x[toks]
            if repetition != 1:
                v = torch.where(v > 0, v / repetition, v * repetition)
            seen = counts > 0
            v = torch.where(seen, v - (frequency * counts.float() + presence), v)
            x[toks] = v
        tokens[r] = torch.argmax(x)
        if temperature <= 0 or x.max() == float("-inf"):
            continue
        xt = x / temperature
        keep = sampling_mask(xt, top_k, float(top_p), float(min_p))
        score = (xt + gumbel_noise(vocab, seed, position, x.device)).masked_fill(~keep, float("-inf"))
        tokens[r] = torch.argmax(score)
    chosen = raw_lp.gather(1, tokens[:, None])[:, 0]
    return tokens, chosen, (raw_lp if return_logprobs else None)


# Bit j of byte b, for unpacking masks a byte at a time (the int32 words are little-endian in memory).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor | None = None) -> None:
    """In place on logits [S, V]: -inf for each token a row's grammar mask does not allow. Row r uses mask
    row mask_index[r] of bitmask [G, W] (int32, bit v % 32 of word v // 32 is token v), or none when that is
    -1; without mask_index row r uses mask row r. Tokens past 32 W are masked."""
    num_rows, vocab = logits.shape
    if mask_index is None:
        rows, slots = None, torch.arange(num_rows)
    else:
        index = mask_index.to("cpu", torch.long)
        picked = torch.nonzero(index >= 0).flatten()
        if picked.numel() == 0:
            return
        rows, slots = (None, index) if picked.numel() == num_rows else (picked, index[picked])
    words = bitmask.to("cpu", torch.int32)[slots].contiguous()
    # A byte table lookup, not 32 shifts per word: this runs on the CPU path every constrained step.
    allowed = _BYTE_BITS[words.view(torch.uint8).long()].view(words.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbid = ~allowed[:, :vocab].to(logits.device)
    if rows is None:
        logits.masked_fill_(forbid, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(forbid, float("-inf"))
