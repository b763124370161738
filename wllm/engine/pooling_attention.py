"""Attention for a step of whole prompts that no later step reads (pooling models): no KV cache at all.

A pooling prompt runs whole in one step and is done, so its keys and values are never read again: writing them
to the paged cache and attending each sequence on its own (`PagedAttentionContext`) costs a cache write and one
attention call per sequence per layer. On a CPU each small call pays a thread-pool wake-up (milliseconds on a
loaded machine), which made a 64-prompt step spend most of its time in 384 tiny attention calls (issue 35).

Here the step's sequences are padded into a few `[B, H, L, D]` batches, one attention call each: sequences are
sorted by length and cut into groups whose padded attention area (size x width^2) stays within `PAD_SLACK` of
their own (one group when the lengths are close, as in a typical embedding batch), with a key-padding mask when a
group's lengths differ.
A group of equal-length sequences that are adjacent in the step is a view, with no copy.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

# Padded attention area per real area of a group: more groups cost more calls (thread wake-ups), more padding
# costs more work; 1.5 by measurement (benchmarks/RESULTS.md, issue 35).
PAD_SLACK = 1.5


class _Group:
    """Sequences attended in one call: `size` of them padded to `width` tokens."""

    def __init__(self, members: list[int], lens: list[int], starts: list[int], device: torch.device) -> None:
        self.size = len(members)
        self.width = max(lens[i] for i in members)
        self.lens = [lens[i] for i in members]
        self.equal = all(n == self.width for n in self.lens)
        first = starts[members[0]]
        self.adjacent = self.equal and all(starts[i] == first + j * self.width for j, i in enumerate(members))
        self.first = first
        self.device = device
        self.masks: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        if self.adjacent:
            return
        # gather[j * width + t]: the step row of member j's token t (row `first` stands in for padding, masked
        # out as a key and never read back); rows/slots: each real token's step row and padded slot.
        gather, rows, slots = [], [], []
        for j, i in enumerate(members):
            n, s = lens[i], starts[i]
            gather.extend(range(s, s + n))
            gather.extend([first] * (self.width - n))
            rows.extend(range(s, s + n))
            slots.extend(range(j * self.width, j * self.width + n))
        self.gather = torch.tensor(gather, dtype=torch.long, device=device)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.len_t = torch.tensor(self.lens, device=device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, D] step rows -> [size, heads, width, D]."""
        if self.adjacent:
            rows = x[self.first:self.first + self.size * self.width]
        else:
            rows = x.index_select(0, self.gather)
        return rows.view(self.size, self.width, *x.shape[1:]).transpose(1, 2)

    def mask(self, causal: bool, window: int | None) -> torch.Tensor | None:
        """Allowed keys, [size, 1, width | 1, width] (None: all of them; causal alone goes to is_causal)."""
        key = (causal, window)
        if key not in self.masks:
            allowed = None
            k_pos = torch.arange(self.width, device=self.device)[None, :]
            if not self.equal:
                allowed = (k_pos < self.len_t[:, None])[:, None, None, :]
            if window is not None or (causal and allowed is not None):
                q_pos = k_pos.view(-1, 1)
                tri = k_pos <= q_pos if causal else torch.ones(self.width, self.width, dtype=torch.bool,
                                                               device=self.device)
                if window is not None:
                    tri = tri & (k_pos > q_pos - window)
                allowed = tri[None, None] if allowed is None else allowed & tri[None, None]
            self.masks[key] = allowed
        return self.masks[key]


class PoolingAttentionContext:
    """`AttentionContext` for a step of whole prompts (every sequence from position 0), stored nowhere."""

    def __init__(self, num_new: Seq[int], device: torch.device) -> None:
        lens = [int(n) for n in num_new]
        if any(n <= 0 for n in lens):
            raise ValueError("every sequence of a pooling step has tokens")
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        self.num_tokens = sum(lens)
        self.groups: list[_Group] = []
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        while order:
            width, members, area = lens[order[0]], [], 0
            while order and (len(members) + 1) * width**2 <= PAD_SLACK * (area + lens[order[0]] ** 2):
                area += lens[order[0]] ** 2
                members.append(order.pop(0))
            members.sort()  # step order: equal-length neighbours stay a view
            self.groups.append(_Group(members, lens, starts, torch.device(device)))
        # One group covering the step in step order: its padded output, read in order, is the result.
        self._whole = len(self.groups) == 1 and (self.groups[0].adjacent
                                                 or self.groups[0].rows.numel() == self.num_tokens)

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
        """Attention of each sequence over itself, one call per group; k/v are not kept."""
        num_heads, head_dim = q.shape[1], v.shape[-1]
        group_size = num_heads // k.shape[1]
        out = None if self._whole else q.new_empty(q.shape[0], num_heads, head_dim)
        for g in self.groups:
            qg, kg, vg = g.pad(q), g.pad(k), g.pad(v)
            if group_size > 1:  # grouped-query attention: repeat the KV heads
                kg, vg = kg.repeat_interleave(group_size, dim=1), vg.repeat_interleave(group_size, dim=1)
            mask = g.mask(causal, sliding_window)
            if logit_softcap:
                o = _softcapped(qg, kg, vg, scale, logit_softcap, mask, causal and mask is None)
            else:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                   is_causal=causal and mask is None)
            o = o.transpose(1, 2)  # [size, width, H, D]
            if g.adjacent:
                if out is None:
                    return o.reshape(-1, num_heads, head_dim)
                out[g.first:g.first + g.size * g.width] = o.reshape(-1, num_heads, head_dim)
                continue
            flat = o.reshape(-1, num_heads, head_dim).index_select(0, g.slots)
            if out is None:
                return flat
            out.index_copy_(0, g.rows, flat)
        assert out is not None
        return out


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Soft-capped attention in fp32 ([B, H, L, D] each): c * tanh(scores / c) before the softmax."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = cap * torch.tanh(scores / cap)
    if causal:
        width = q.shape[2]
        mask = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
