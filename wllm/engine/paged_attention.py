"""Attention over a paged KV cache, in plain PyTorch (the CPU path and the oracle for CUDA kernels).

KV cache layout: one tensor per engine, `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]` (index 0 of dim 1 = keys, 1 = values); layer `l` uses the view `cache[l]`. Token slot
`s` of the cache is block `s // block_size`, offset `s % block_size`. Keeping every layer in one
tensor makes a swap or a block copy one indexed copy for the whole model.

A step's batch is flattened: the new tokens of sequence `i` are rows
`query_start[i]:query_start[i + 1]` of q/k/v, at positions `start_pos[i] + 0, 1, ...`; the
sequence's earlier tokens (computed in earlier steps or shared through the prefix cache) are
already in its blocks. `attend` first writes the new keys and values of the whole batch, then
attends each sequence over its first `start_pos[i] + num_new[i]` slots, so one batch may mix
prompt chunks, prefix hits and decode tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A zeroed KV cache tensor in the layout above."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def copy_blocks(cache: torch.Tensor, pairs: Seq[tuple[int, int]]) -> None:
    """Copy whole blocks (src -> dst) inside one cache, all layers in one indexed copy."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=cache.device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=cache.device)
    cache[:, :, dst] = cache[:, :, src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: Seq[tuple[int, int]]) -> None:
    """Copy blocks between two caches (GPU <-> CPU pool) in one batched copy."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_cache.device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_cache.device)
    gathered = src_cache[:, :, src].to(dst_cache.device, non_blocking=dst_cache.device.type == "cuda")
    dst_cache[:, :, dst] = gathered


class PagedAttentionContext:
    """`AttentionContext` for one engine step over the paged cache (PyTorch gather path)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_tables: Seq[Seq[int]],
        start_pos: Seq[int],
        num_new: Seq[int],
    ) -> None:
        if not len(block_tables) == len(start_pos) == len(num_new):
            raise ValueError("block_tables, start_pos and num_new must have one entry per sequence")
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        device = kv_cache.device
        bs = self.block_size
        self.start_pos = list(start_pos)
        self.num_new = list(num_new)
        self.query_start = [0]
        slot_parts: list[torch.Tensor] = []
        self.context_slots: list[torch.Tensor] = []
        offsets = torch.arange(bs, device=device)
        for table, start, n in zip(block_tables, start_pos, num_new):
            ctx_len = start + n
            if len(table) * bs < ctx_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx_len} tokens")
            blocks = torch.tensor(list(table), dtype=torch.long, device=device)
            slots = (blocks[:, None] * bs + offsets[None, :]).reshape(-1)[:ctx_len]
            self.context_slots.append(slots)
            slot_parts.append(slots[start:])
            self.query_start.append(self.query_start[-1] + n)
        self.slot_mapping = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.long)
        self._masks: dict[tuple[int, int | None, bool], torch.Tensor | None] = {}
        # Single-token (decode) sequences are attended together: their contexts are gathered into
        # one padded [B, max_ctx] slot matrix, with padding masked out.
        self.decode_idx = [i for i, n in enumerate(self.num_new) if n == 1]
        self.other_idx = [i for i, n in enumerate(self.num_new) if n != 1]
        self._decode_masks: dict[int | None, torch.Tensor] = {}
        if len(self.decode_idx) > 1:
            lens = torch.tensor([self.start_pos[i] + 1 for i in self.decode_idx], device=device)
            width = int(lens.max())
            pad = torch.zeros(len(self.decode_idx), width, dtype=torch.long, device=device)
            for row, i in enumerate(self.decode_idx):
                pad[row, : self.context_slots[i].numel()] = self.context_slots[i]
            self.decode_slots = pad
            self.decode_rows = torch.tensor([self.query_start[i] for i in self.decode_idx], device=device)
            self.decode_lens = lens
        else:
            self.other_idx = list(range(len(self.num_new)))
            self.decode_idx = []

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    def _mask(self, i: int, window: int | None, causal: bool) -> torch.Tensor | None:
        """Boolean [num_new, ctx_len] mask of allowed keys for sequence i (None = all allowed)."""
        key = (i, window, causal)
        if key not in self._masks:
            start, n = self.start_pos[i], self.num_new[i]
            ctx_len = start + n
            if (not causal or n == 1) and (window is None or window >= ctx_len):
                self._masks[key] = None
            else:
                device = self.kv_cache.device
                q_pos = torch.arange(start, ctx_len, device=device)[:, None]
                k_pos = torch.arange(ctx_len, device=device)[None, :]
                allowed = k_pos <= q_pos if causal else torch.ones(n, ctx_len, dtype=torch.bool, device=device)
                if window is not None:
                    allowed = allowed & (k_pos > q_pos - window)
                self._masks[key] = allowed
        return self._masks[key]

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal: bool = True,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Store the batch's new k/v in the cache, then attend each sequence over its context."""
        layer = self.kv_cache[layer_idx]
        num_kv_heads, head_dim = layer.shape[-2], layer.shape[-1]
        k_flat = layer[0].view(-1, num_kv_heads, head_dim)
        v_flat = layer[1].view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self.slot_mapping, k.reshape(-1, num_kv_heads, head_dim).to(layer.dtype))
        v_flat.index_copy_(0, self.slot_mapping, v.reshape(-1, num_kv_heads, head_dim).to(layer.dtype))

        num_heads = q.shape[1]
        out = torch.empty(q.shape[0], num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
        if self.decode_idx:
            out[self.decode_rows] = self._attend_decodes(q, k_flat, v_flat, scale, sliding_window, logit_softcap)
        for i in self.other_idx:
            lo, hi = self.query_start[i], self.query_start[i + 1]
            out[lo:hi] = self._attend_one(i, q[lo:hi], k_flat, v_flat, scale, causal, sliding_window,
                                          logit_softcap)
        return out

    def _attend_one(self, i: int, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, scale: float,
                    causal: bool, window: int | None, softcap: float | None) -> torch.Tensor:
        """Attention of sequence i's new tokens (q [n, H, D]) over its whole context."""
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_flat.shape[1]
        group = num_heads // num_kv_heads
        slots = self.context_slots[i]
        mask = self._mask(i, window, causal)
        if not softcap:
            # Fused SDPA kernel; KV heads repeated for grouped-query attention.
            def heads(flat: torch.Tensor) -> torch.Tensor:  # [ctx, Hkv, D] -> [1, H, ctx, D]
                rows = flat.index_select(0, slots).transpose(0, 1)
                return rows.repeat_interleave(group, dim=0).unsqueeze(0).to(q.dtype)

            keys, values = heads(k_flat), heads(v_flat)
            whole_causal = causal and mask is not None and self.start_pos[i] == 0 and window is None
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=None if whole_causal else mask,
                is_causal=whole_causal, scale=scale)
            return o[0].transpose(0, 1)
        # Soft-capped scores need the explicit path: [kv_heads, group, n, d] x [kv_heads, d, ctx].
        qs = q.float().reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        keys = k_flat[slots].float().permute(1, 2, 0)
        values = v_flat[slots].float().permute(1, 0, 2)
        scores = torch.matmul(qs, keys.unsqueeze(1)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, values.unsqueeze(1))  # [kv_heads, group, n, d]
        return o.permute(2, 0, 1, 3).reshape(n, num_heads, -1).to(q.dtype)

    def _gather_decode(self, flat: torch.Tensor) -> torch.Tensor:
        """[B, max_ctx, Hkv, D] cache rows of the decode batch (index_select beats fancy indexing)."""
        batch, width = self.decode_slots.shape
        return flat.index_select(0, self.decode_slots.view(-1)).view(batch, width, *flat.shape[1:])

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, max_ctx] allowed keys of the decode batch (padding and out-of-window off)."""
        if window not in self._decode_masks:
            k_pos = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)[None, :]
            allowed = k_pos < self.decode_lens[:, None]
            if window is not None:
                allowed = allowed & (k_pos > (self.decode_lens[:, None] - 1) - window)
            self._decode_masks[window] = allowed[:, None, None, :]
        return self._decode_masks[window]

    def _attend_decodes(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, scale: float,
                        window: int | None, softcap: float | None) -> torch.Tensor:
        batch = len(self.decode_idx)
        num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
        if not softcap:
            # The G query heads sharing a KV head act as G queries: no repeat of K/V needed.
            qd = q[self.decode_rows].reshape(batch, num_kv_heads, -1, head_dim)
            keys = self._gather_decode(k_flat).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            values = self._gather_decode(v_flat).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=self._decode_mask(window), scale=scale)
            return o.reshape(batch, -1, head_dim)
        qd = q[self.decode_rows].float().reshape(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
        keys = self._gather_decode(k_flat).float().permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        scores = torch.matmul(qd, keys) * scale  # [B, Hkv, G, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~self._decode_mask(window), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        values = self._gather_decode(v_flat).float().permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        o = torch.matmul(probs, values)  # [B, Hkv, G, D]
        return o.reshape(batch, -1, o.shape[-1]).to(q.dtype)
