"""The seam between model code and the engine's KV cache.

Models never own a KV cache. Their forward takes flattened tokens of a whole batch
(`input_ids[T]`, `positions[T]`) plus an `AttentionContext`; each attention layer projects
q/k/v and calls `ctx.attend(layer_idx, q, k, v, ...)`. The context knows which tokens belong
to which sequence, where their K/V go (contiguous per-sequence tensors in tests, paged blocks
in the engine) and computes attention over everything cached so far plus the new tokens.

Layers with rotary embeddings call `attend_with_rotary(ctx, layer_idx, q, k, v, positions,
rotary, ...)` instead. A context may implement the optional method `attend_rotary(layer_idx, q, k,
v, positions, rotary, **same keywords as attend)` to rotate and store in one step (the CUDA context
fuses the rotary kernel into the KV-cache write; it may read `rotary`'s cos/sin table and style);
any other context gets `rotary(positions, q, k)` followed by `attend`, so a context that only has
`attend` keeps working unchanged. Either way q may be rotated in place and k must not be read
afterwards. A context may also offer `qkv_rotary_attend(layer_idx, hidden, qkv_proj, positions, rotary,
num_heads, **attend's keywords)`, which projects `hidden` itself (the CUDA context fuses the qkv GEMV,
the rotation and the KV write at decode batch sizes) and returns None when it does not apply; the
decoder attention layers try it first.

Shapes: q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]; the result is
[T, num_heads, head_dim]. Tokens of one sequence are contiguous in T and in position order.
"""

from __future__ import annotations

from collections.abc import Callable
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


def attend_with_rotary(
    ctx: AttentionContext,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Rotate q and k by their positions and attend: `ctx.attend_rotary` when the context has one,
    else `rotary(positions, q, k)` (in place) followed by `ctx.attend`. Do not read k afterwards."""
    fused = getattr(ctx, "attend_rotary", None)
    if fused is not None:
        return fused(layer_idx, q, k, v, positions, rotary, scale=scale, causal=causal,
                     sliding_window=sliding_window, logit_softcap=logit_softcap)
    rotary(positions, q, k)
    return ctx.attend(layer_idx, q, k, v, scale=scale, causal=causal, sliding_window=sliding_window,
                      logit_softcap=logit_softcap)
