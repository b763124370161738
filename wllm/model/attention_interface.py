"""The seam between model code and the engine's KV cache.

Models never own a KV cache. Their forward takes flattened tokens of a whole batch
(`input_ids[T]`, `positions[T]`) plus an `AttentionContext`; each attention layer projects
q/k/v and calls `ctx.attend(layer_idx, q, k, v, ...)`. The context knows which tokens belong
to which sequence, where their K/V go (contiguous per-sequence tensors in tests, paged blocks
in the engine) and computes attention over everything cached so far plus the new tokens.

Shapes: q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]; the result is
[T, num_heads, head_dim]. Tokens of one sequence are contiguous in T and in position order.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionContext(Protocol):
    """What a model needs from the engine to run attention for one forward pass."""

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
        """Store k/v for the new tokens of this layer and return attention output for q.

        `sliding_window` = W means a query at position p sees keys at positions > p - W
        (HF semantics). `logit_softcap` = c applies c * tanh(scores / c) before softmax.
        """
        ...
