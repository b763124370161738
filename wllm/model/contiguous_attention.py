"""A simple, obviously-correct attention context: per-sequence K/V tensors grown by concatenation.

Used by tests and as the CPU reference for the paged engine. Before each forward call
`prepare(seq_ids, num_new_tokens)` to say which sequences the flattened tokens belong to (in
order); each sequence's new tokens continue after what is already cached for it, so a batch
can mix prefills and decodes of different lengths.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from wllm.model.models.base import ModelBase


class ContiguousAttention:
    """`AttentionContext` keeping each sequence's K/V per layer as one growing tensor."""

    def __init__(self) -> None:
        # seq_id -> layer_idx -> (k [L, Hkv, D], v [L, Hkv, D])
        self._cache: dict[Hashable, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lens: dict[Hashable, int] = {}
        self._seq_ids: list[Hashable] = []
        self._new: list[int] = []

    def prepare(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> None:
        """Declare the layout of the next forward: tokens of seq_ids[i] are the next num_new_tokens[i]."""
        if len(seq_ids) != len(num_new_tokens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must be unique and match num_new_tokens one to one")
        # Lengths advance once per forward (after all layers ran), so commit the previous step now.
        for sid, n in zip(self._seq_ids, self._new):
            self._lens[sid] = self._lens.get(sid, 0) + n
        self._seq_ids = list(seq_ids)
        self._new = [int(n) for n in num_new_tokens]

    def cached_len(self, seq_id: Hashable) -> int:
        """Tokens of `seq_id` stored so far (including the forward in progress once it ran)."""
        pending = dict(zip(self._seq_ids, self._new)).get(seq_id, 0)
        return self._lens.get(seq_id, 0) + pending

    def free(self, seq_id: Hashable) -> None:
        """Drop a finished sequence's K/V."""
        self._cache.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        if seq_id in self._seq_ids:
            i = self._seq_ids.index(seq_id)
            del self._seq_ids[i], self._new[i]

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
        """Append k/v of the new tokens per sequence and attend q over each sequence's keys."""
        if q.shape[0] != sum(self._new):
            raise ValueError(f"forward has {q.shape[0]} tokens but prepare() declared {sum(self._new)}")
        outs = []
        start = 0
        for sid, n in zip(self._seq_ids, self._new):
            past = self._lens.get(sid, 0)
            layers = self._cache.setdefault(sid, {})
            k_new, v_new = k[start : start + n], v[start : start + n]
            if layer_idx in layers:
                k_old, v_old = layers[layer_idx]
                if k_old.shape[0] != past:
                    raise RuntimeError(f"layer {layer_idx} of sequence {sid!r} cached {k_old.shape[0]} != {past}")
                k_all, v_all = torch.cat((k_old, k_new)), torch.cat((v_old, v_new))
            else:
                k_all, v_all = k_new.clone(), v_new.clone()
            layers[layer_idx] = (k_all, v_all)
            q_pos = torch.arange(past, past + n, device=q.device)
            outs.append(
                _attention(q[start : start + n], k_all, v_all, q_pos, scale, causal, sliding_window, logit_softcap)
            )
            start += n
        return torch.cat(outs) if outs else q.new_empty(q.shape)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Reference attention in fp32: q [n, H, D], k/v [L, Hkv, D] -> [n, H, D] in q.dtype."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k.shape[0], device=q.device)
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


@torch.inference_mode()
def greedy_generate(model: ModelBase, prompt_ids: Sequence[int] | torch.Tensor, n: int) -> list[int]:
    """Greedy continuation of `n` tokens with a fresh ContiguousAttention (for tests)."""
    if n <= 0:
        return []
    device = next(model.parameters()).device
    ids = [int(t) for t in prompt_ids]
    ctx = ContiguousAttention()
    ctx.prepare([0], [len(ids)])
    tokens = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.arange(len(ids), device=device)
    out: list[int] = []
    while True:
        hidden = model(tokens, positions, ctx)
        nxt = int(model.compute_logits(hidden[-1:]).argmax(-1).item())
        out.append(nxt)
        if len(out) >= n:
            return out
        pos = int(positions[-1].item()) + 1
        ctx.prepare([0], [1])
        tokens = torch.tensor([nxt], dtype=torch.long, device=device)
        positions = torch.tensor([pos], device=device)
