"""`PoolingAttentionContext` (a pooling step's batched attention, no KV cache) against the paged context it
stands in for: mixed lengths (padded groups and adjacent views), causal, sliding window, soft-capping, GQA."""

from __future__ import annotations

import pytest
import torch

from wllm.engine.paged_attention import PagedAttentionContext, allocate_kv_cache
from wllm.engine.pooling_attention import PoolingAttentionContext


def _paged(lens: list[int], num_kv_heads: int, head_dim: int) -> PagedAttentionContext:
    block = 4
    cache = allocate_kv_cache(1, sum(-(-n // block) for n in lens), block, num_kv_heads, head_dim, torch.float32,
                              "cpu")
    tables, b = [], 0
    for n in lens:
        tables.append(list(range(b, b + -(-n // block))))
        b += len(tables[-1])
    return PagedAttentionContext(cache, tables, [0] * len(lens), lens)


@pytest.mark.parametrize("lens", [[7], [5, 5, 5], [9, 3, 9, 9, 1, 30, 28, 29], [2, 40]])
@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(causal=True, sliding_window=4),
                                dict(causal=False, logit_softcap=5.0), dict(causal=True, logit_softcap=5.0)])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_matches_paged_attention(lens: list[int], kw: dict, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    t, heads, d = sum(lens), 4, 8
    q, k, v = torch.randn(t, heads, d), torch.randn(t, num_kv_heads, d), torch.randn(t, num_kv_heads, d)
    ours = PoolingAttentionContext(lens, torch.device("cpu")).attend(0, q.clone(), k, v, scale=d**-0.5, **kw)
    ref = _paged(lens, num_kv_heads, d).attend(0, q.clone(), k, v, scale=d**-0.5, **kw)
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() < 1e-5


def test_groups_bound_the_padding() -> None:
    ctx = PoolingAttentionContext([30, 29, 31, 30], torch.device("cpu"))
    assert len(ctx.groups) == 1  # close lengths: one call
    ctx = PoolingAttentionContext([100, 2, 3, 100, 50], torch.device("cpu"))
    assert [(g.size, g.width) for g in ctx.groups] == [(3, 100), (2, 3)]
    for g in ctx.groups:  # padded attention area within 1.5x the group's own
        assert g.size * g.width**2 <= 1.5 * sum(n * n for n in g.lens)
    equal = PoolingAttentionContext([6, 6, 6], torch.device("cpu"))
    assert equal.groups[0].adjacent  # a view of the step's rows, no gather
