"""The qkv projection with the rotary embedding and the KV-cache write fused in (`gemv_rotary_cache`) and
its use by decode attention layers (`CudaAttentionContext.qkv_rotary_attend`).

CPU (CI): the composition against a float64 oracle (the product rounded to the dtype, then rotated and
rounded once), argument errors. CUDA (-m cuda): the kernel against the reference on odd head counts, both
pairings, partial rotary, bias, padding slots, 1-5 rows; layouts it cannot stream (fallback); inside a
CUDA graph behind the norm with PDL and decode attention after it; a decode layer fused vs unfused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_rope_cache import naive_rotary_and_cache

from wllm import kernels
from wllm.engine.cuda_attention import CudaAttentionContext
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import reference
from wllm.kernels.gemv import gemv_rotary_cache
from wllm.model.layers import linear_method
from wllm.model.layers.linear_method import select_kernels

TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def make(tokens: int, heads: int, kv_heads: int, head_size: int, k: int, rot_dim: int, dtype: torch.dtype,
         bias: bool, device: str = "cpu", seed: int = 0, block_size: int = 16):
    """x, weight (q | k | v heads), bias, a random one-layer cache, scattered slots (every other row from
    the second one is padding), positions, cos/sin table."""
    gen = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * kv_heads) * head_size
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    w = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if bias else None
    num_blocks = tokens + 3
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[1::2] = -1
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    table = kernels.rotary_cos_sin_cache(4096, rot_dim, 500000.0)
    to = (lambda t: t.to(device) if t is not None else None)
    return to(x), to(w), to(b), to(cache), to(slots), to(positions), to(table)


def oracle(x, w, b, cache, slots, positions, table, heads, neox):
    """float64 product rounded to the dtype (as a GEMM stores it), then the float64 rotary/cache loop."""
    y = x.double() @ w.double().t()
    if b is not None:
        y += b.double()
    y = y.to(x.dtype).cpu()
    kv_heads, head_size = cache.shape[4], cache.shape[5]
    q = y[:, : heads * head_size].view(-1, heads, head_size)
    k = y[:, heads * head_size : (heads + kv_heads) * head_size].view(-1, kv_heads, head_size)
    v = y[:, (heads + kv_heads) * head_size :].view(-1, kv_heads, head_size)
    return naive_rotary_and_cache(positions.cpu(), q, k, v, cache.cpu(), slots.cpu(), table.cpu(), neox)


def run(x, w, b, cache, slots, positions, table, heads, neox):
    out_cache = cache.clone()
    q = gemv_rotary_cache(x, w, b, positions, slots, table, out_cache[0, 0], out_cache[0, 1], heads, neox)
    return q, out_cache


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_float64(neox: bool, rot_dim: int, bias: bool) -> None:
    x, w, b, cache, slots, positions, table = make(3, 4, 2, 64, 72, rot_dim, torch.bfloat16, bias)
    q, out_cache = run(x, w, b, cache, slots, positions, table, 4, neox)
    want_q, want_cache = oracle(x, w, b, cache, slots, positions, table, 4, neox)
    assert q.shape == (3, 4, 64)
    torch.testing.assert_close(q, want_q, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])
    torch.testing.assert_close(out_cache, want_cache, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])


def test_errors() -> None:
    x, w, b, cache, slots, positions, table = make(2, 4, 2, 64, 72, 64, torch.bfloat16, False)
    with pytest.raises(ValueError, match="weight must have 512 rows"):
        gemv_rotary_cache(x, w[:-1], b, positions, slots, table, cache[0, 0], cache[0, 1], 4, True)
    with pytest.raises(ValueError, match="int64"):
        gemv_rotary_cache(x, w, b, positions.int(), slots, table, cache[0, 0], cache[0, 1], 4, True)
    with pytest.raises(ValueError, match="even rot_dim"):
        gemv_rotary_cache(x, w, b, positions, slots, table[:, :63], cache[0, 0], cache[0, 1], 4, True)
    with pytest.raises(ValueError, match="caches must both be"):
        gemv_rotary_cache(x, w, b, positions, slots, table, cache[0, 0], cache[0, 1, :2], 4, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_size,rot_dim", [(32, 8, 128, 128), (14, 2, 64, 64), (5, 1, 80, 80),
                                                              (4, 2, 128, 64), (3, 3, 64, 32)])
@pytest.mark.parametrize("k", [904, 4096])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_kernel_matches_float64(dtype, neox, heads, kv_heads, head_size, rot_dim, k, tokens) -> None:
    """Odd head counts and GQA ratios, partial rotary, both pairings, 1-2 rows (one launch) and 5 (three
    passes), padding slots: q and the whole cache (written slots and the untouched rest) match."""
    bias = (heads + tokens) % 2 == 1
    x, w, b, cache, slots, positions, table = make(tokens, heads, kv_heads, head_size, k, rot_dim, dtype, bias,
                                                   device="cuda", seed=heads * 7 + k + tokens)
    q, out_cache = run(x, w, b, cache, slots, positions, table, heads, neox)
    want_q, want_cache = oracle(x, w, b, cache, slots, positions, table, heads, neox)
    torch.testing.assert_close(q.cpu(), want_q, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    torch.testing.assert_close(out_cache.cpu(), want_cache, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["misaligned_weight", "odd_k", "strided_x"])
def test_kernel_layouts_and_fallback(layout: str) -> None:
    """A weight the kernel cannot stream in 16-byte rows (misaligned, K not a multiple of 8) falls back to
    gemv + rotary_and_cache; strided rows of x stay on the kernel. All match the oracle."""
    k = 13 if layout == "odd_k" else 264
    x, w, b, cache, slots, positions, table = make(2, 4, 2, 64, k, 64, torch.bfloat16, True, device="cuda", seed=3)
    if layout == "misaligned_weight":
        big = torch.randn(w.shape[0], k + 1, device="cuda").to(w.dtype)
        big[:, 1:] = w
        w = big[:, 1:]
    elif layout == "strided_x":
        big = torch.randn(2, 2 * k, device="cuda").to(x.dtype)
        big[:, :k] = x
        x = big[:, :k]
    q, out_cache = run(x, w, b, cache, slots, positions, table, 4, True)
    want_q, want_cache = oracle(x, w, b, cache, slots, positions, table, 4, True)
    torch.testing.assert_close(q.cpu(), want_q, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out_cache.cpu(), want_cache, rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("context", [37, 300])
def test_in_a_graph_behind_the_norm_then_decode_attention(context: int) -> None:
    """norm -> fused qkv/rotary/cache -> paged decode attention in a CUDA graph with PDL on (the fused
    kernel triggers attention early, like rotary_and_cache): each replay with a new x and position matches
    gemv + rotary_and_cache + attention run eagerly on the same inputs."""
    heads, kv_heads, d, k, bs = 8, 2, 128, 1024, 16
    x, w, b, _, _, _, table = make(1, heads, kv_heads, d, k, d, torch.bfloat16, False, device="cuda", seed=5)
    blocks = context // bs + 2
    cache = torch.randn(1, 2, blocks, bs, kv_heads, d, device="cuda").to(torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda")[: blocks - 1].to(torch.int32).view(1, -1)
    seq_lens = torch.tensor([context], device="cuda", dtype=torch.int32)
    positions = torch.tensor([context - 1], device="cuda")
    slots = (tables[0, (context - 1) // bs].long() * bs + (context - 1) % bs).view(1)
    residual = torch.zeros_like(x)
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    max_len = tables.shape[1] * bs
    ws = kernels.decode_workspace_size(1, heads, kv_heads, d, max_len)
    workspace = torch.zeros(max((ws + 3) // 4, 1), device="cuda")

    def step(fused: bool, c: torch.Tensor) -> torch.Tensor:
        kernels.fused_add_rms_norm(x, residual, norm_w, 1e-6)
        if fused:
            q = gemv_rotary_cache(x, w, b, positions, slots, table, c[0, 0], c[0, 1], heads, True)
        else:
            qkv = kernels.gemv(x, w, b)
            q, kk, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q = q.reshape(1, heads, d).contiguous()
            kernels.rotary_and_cache(positions, q, kk, v, c[0, 0], c[0, 1], slots, table, True)
        return kernels.paged_decode_attention(q, c[0, 0], c[0, 1], tables, seq_lens, d**-0.5, max_seq_len=max_len,
                                              workspace=workspace)

    graph_cache = cache.clone()
    previous = kernels.set_pdl(True)
    try:
        graph, out = capture_graph(lambda: step(True, graph_cache))
    finally:
        kernels.set_pdl(previous)
    for trial in range(3):
        x0, r0 = torch.randn_like(x), torch.randn_like(residual)
        x.copy_(x0)
        residual.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        got, got_cache = out.clone(), graph_cache.clone()
        x.copy_(x0)
        residual.copy_(r0)
        eager_cache = graph_cache.clone()
        want = step(False, eager_cache)
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=lambda m, t=trial: f"replay {t}: {m}")
        torch.testing.assert_close(got_cache, eager_cache, rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("max_bytes", [None, 1 << 20])
def test_decode_layer_takes_the_fused_path(max_bytes: int | None, monkeypatch) -> None:
    """A bf16 Llama attention layer (12 MB qkv) on a one-row decode step runs `gemv_rotary_cache` (no
    separate rotary_and_cache); with a table whose fused_qkv_rotary_max_bytes is below its qkv weight, the
    separate kernels; both give the same output and cache up to bf16 rounding of the projection's sums."""
    if max_bytes is not None:
        real_table_for = linear_method.table_for
        monkeypatch.setattr(linear_method, "table_for", lambda cap: dataclasses.replace(
            real_table_for(cap), fused_qkv_rotary_max_bytes=max_bytes))
    from wllm.model.config import ModelConfig
    from wllm.model.layers import RotaryEmbedding
    from wllm.model.models.llama import DecoderAttention

    calls = []
    real = linear_method.gemv_rotary_cache
    monkeypatch.setattr(linear_method, "gemv_rotary_cache", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 16,
                                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 64,
                                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0})
    torch.manual_seed(0)
    layer = DecoderAttention(config, 0, RotaryEmbedding(config), qkv_bias=False, o_bias=False).to("cuda",
                                                                                                  torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(std=2048**-0.5)
    select_kernels(layer)
    bs, blocks, context = 16, 8, 70
    kv = torch.randn(1, 2, blocks, bs, 4, 128, device="cuda").to(torch.bfloat16)
    tables = torch.arange(blocks - 1, device="cuda", dtype=torch.int32).view(1, -1)
    positions = torch.tensor([context - 1], device="cuda")
    slots = positions.clone()
    ctx = CudaAttentionContext([(kv[0, 0], kv[0, 1])], slots, tables,
                               torch.tensor([context], device="cuda", dtype=torch.int32),
                               torch.tensor([0, 1], device="cuda", dtype=torch.int32), decode=True,
                               max_seq_len=(blocks - 1) * bs)
    hidden = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    out = layer(positions, hidden, ctx)
    assert calls == ([1] if max_bytes is None else [])
    # The unfused path from first principles: projection, rotary, cache write, attention, o_proj.
    qkv = reference.gemv(hidden, layer.qkv_proj.weight)
    q, k, v = qkv.split([16 * 128, 4 * 128, 4 * 128], dim=-1)
    q = q.reshape(1, 16, 128).clone()
    want_kv = kv.clone()
    reference.rotary_and_cache(positions, q, k, v, want_kv[0, 0], want_kv[0, 1], slots,
                               layer.rotary.cos_sin_cache(positions.device), True)
    attn = reference.paged_decode_attention(q, want_kv[0, 0], want_kv[0, 1], tables, ctx.seq_lens, layer.scale)
    want = reference.gemv(attn.reshape(1, -1), layer.o_proj.weight)
    torch.testing.assert_close(kv, want_kv, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, want, rtol=5e-2, atol=5e-2)
