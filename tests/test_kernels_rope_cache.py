"""Rotary embedding fused with the KV-cache write (`rotary_and_cache`) and the `attend_rotary` seam.

CPU: the reference against a per-token float64 loop; the default `attend_with_rotary` against
rotary + attend; the CUDA context's fused override (run on the references) against its unfused
path. GPU (-m cuda): the kernel against the reference and against the two kernels it replaces, on
odd sizes, padding slots, partial rotary, both pairings, strided qkv views, and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from wllm import kernels
from wllm.engine.cuda_attention import CudaAttentionContext
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import reference
from wllm.model.attention_interface import attend_with_rotary
from wllm.model.config import ModelConfig
from wllm.model.contiguous_attention import ContiguousAttention
from wllm.model.layers import RotaryEmbedding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# About one rounding step of each dtype: the fused kernel and rotary_embedding do the same fp32 math,
# so they may differ at most in the last bit, should the compiler contract a multiply-add differently.
ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make_inputs(tokens: int, heads: int, kv_heads: int, head_size: int, rot_dim: int, block_size: int,
                dtype: torch.dtype, device: str = "cpu", seed: int = 0, pad_every: int = 4):
    """q/k/v as strided views of one fused qkv output, a one-layer engine cache with random contents,
    scattered slots with padding rows (-1), positions and a cos/sin table."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = tokens // block_size + 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype).to(device)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v = qkv[:, (heads + kv_heads) * head_size :].view(tokens, kv_heads, head_size)
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    if pad_every:
        slots[1::pad_every] = -1  # graph padding rows (row 0 stays real, so T=1 writes)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    table = kernels.rotary_cos_sin_cache(4096, rot_dim, 500000.0)
    return qkv, q, k, v, cache, slots.to(device), positions.to(device), table.to(device)


def _rotate_pairs(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (first[i], second[i]) dims of every head of x [H, D] by angle i."""
    x = x.clone()
    a, b = x[..., first].clone(), x[..., second].clone()
    x[..., first], x[..., second] = a * cos - b * sin, b * cos + a * sin
    return x


def naive_rotary_and_cache(positions, q, k, v, cache, slots, table, neox):
    """Per-token, per-head float64 loop: (rotated q, expected cache). Rounded once to the dtype."""
    q_out = q.double().clone()
    want = cache.double().clone()
    block_size, head_size = cache.shape[3], cache.shape[5]
    rot_dim = table.shape[1]
    half = rot_dim // 2
    idx = torch.arange(half)
    first, second = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    for t in range(q.shape[0]):
        angle = (table[positions[t], :half].double(), table[positions[t], half:].double())
        q_out[t] = _rotate_pairs(q_out[t], first, second, *angle)
        slot = int(slots[t])
        if 0 <= slot < cache.shape[2] * block_size:
            want[0, 0, slot // block_size, slot % block_size] = _rotate_pairs(k[t].double(), first, second, *angle)
            want[0, 1, slot // block_size, slot % block_size] = v[t].double()
    assert q_out.shape[-1] == head_size
    return q_out.to(q.dtype), want.to(cache.dtype)


# ------------------------------------------------------------------------------------------
# CPU: reference and the attend_rotary seam
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (80, 24), (96, 96)])
def test_reference_vs_naive_loop(dtype: torch.dtype, neox: bool, head_size: int, rot_dim: int) -> None:
    qkv, q, k, v, cache, slots, pos, table = make_inputs(13, 5, 3, head_size, rot_dim, 16, dtype, seed=1)
    k_before = k.clone()
    want_q, want_cache = naive_rotary_and_cache(pos, q, k, v, cache, slots, table, neox)
    kernels.rotary_and_cache(pos, q, k, v, cache[0, 0], cache[0, 1], slots, table, neox)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(q, want_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(cache, want_cache, rtol=rtol, atol=atol)
    assert torch.equal(k, k_before), "k is an input only"
    assert torch.equal(q[..., rot_dim:], want_q[..., rot_dim:]), "dims past rot_dim pass through"


def test_reference_equals_rotary_then_reshape_and_cache() -> None:
    qkv, q, k, v, cache, slots, pos, table = make_inputs(9, 4, 2, 64, 32, 8, torch.bfloat16, seed=2)
    q2, k2, cache2 = q.clone(), k.clone(), cache.clone()
    kernels.rotary_embedding(pos, q2, k2, 64, table, True)
    kernels.reshape_and_cache(k2, v, cache2[0, 0], cache2[0, 1], slots)
    kernels.rotary_and_cache(pos, q.reshape(9, -1), k, v, cache[0, 0], cache[0, 1], slots, table, True)
    assert torch.equal(q, q2)
    assert torch.equal(cache, cache2)


def test_custom_op_passes_opcheck() -> None:
    qkv, q, k, v, cache, slots, pos, table = make_inputs(5, 2, 1, 16, 16, 4, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.wllm.rotary_and_cache.default,
                          (pos, q.contiguous(), k.contiguous(), v.contiguous(), cache[0, 0], cache[0, 1], slots,
                           table, True))


def _config(head_dim: int, rotary_dim: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=32, hidden_size=4 * head_dim,
                       intermediate_size=8, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=head_dim, partial_rotary_factor=rotary_dim / head_dim,
                       max_position_embeddings=4096)


class _RecordingContext:
    """Only `attend`: what every context written before attend_rotary looks like."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]] = []

    def attend(self, layer_idx, q, k, v, **kwargs):
        self.calls.append((q.clone(), k.clone(), v.clone(), dict(kwargs, layer_idx=layer_idx)))
        return q * 2


def test_default_attend_with_rotary_is_rotary_then_attend() -> None:
    rotary = RotaryEmbedding(_config(64, 32), is_neox=False)
    qkv, q, k, v, cache, slots, pos, table = make_inputs(7, 4, 2, 64, 32, 8, torch.float32, seed=4)
    q_want, k_want = q.clone(), k.clone()
    rotary(pos, q_want, k_want)
    ctx = _RecordingContext()
    out = attend_with_rotary(ctx, 3, q, k, v, pos, rotary, scale=0.5, sliding_window=4, logit_softcap=30.0)
    (q_seen, k_seen, v_seen, kwargs), = ctx.calls
    assert torch.equal(q_seen, q_want) and torch.equal(k_seen, k_want) and torch.equal(v_seen, v)
    assert kwargs == {"layer_idx": 3, "scale": 0.5, "causal": True, "sliding_window": 4, "logit_softcap": 30.0}
    assert torch.equal(out, q_want * 2)


def test_contiguous_context_same_output_through_attend_with_rotary() -> None:
    rotary = RotaryEmbedding(_config(64, 64))
    qkv, q, k, v, cache, slots, pos, table = make_inputs(6, 4, 2, 64, 64, 8, torch.float32, seed=5, pad_every=0)
    pos = torch.arange(6)
    q2, k2 = q.clone(), k.clone()
    rotary(pos, q2, k2)
    plain, via = ContiguousAttention(), ContiguousAttention()
    plain.prepare(["a", "b"], [4, 2])
    via.prepare(["a", "b"], [4, 2])
    want = plain.attend(0, q2, k2, v, scale=0.125)
    got = attend_with_rotary(via, 0, q, k, v, pos, rotary, scale=0.125)
    assert torch.equal(got, want)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_cuda_context_fused_override_matches_unfused_path(decode: bool, rotary_dim: int) -> None:
    """CudaAttentionContext.attend_rotary (on the CPU: the kernels' references) gives the same
    attention output and cache as rotary followed by its plain attend, padding rows included."""
    torch.manual_seed(6)
    rotary = RotaryEmbedding(_config(64, rotary_dim))
    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 64, 8, 12
    lens = [5, 17, 1, 0] if decode else [5, 17, 0]
    new = [1, 1, 1, 0] if decode else [3, 17, 0]
    tables = torch.randperm(num_blocks)[: len(lens) * 3].view(len(lens), 3).int()
    positions, slots = [], []
    for s, (n_ctx, n_new) in enumerate(zip(lens, new)):
        for p in range(n_ctx - n_new, n_ctx):
            positions.append(p)
            slots.append(int(tables[s, p // block_size]) * block_size + p % block_size)
    positions.append(0)  # a padding row
    slots.append(-1)
    positions, slots = torch.tensor(positions), torch.tensor(slots)
    tokens = len(slots)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size)
    q, k, v = (t.view(tokens, -1, head_size) for t in qkv.split([heads * head_size, kv_heads * head_size,
                                                                 kv_heads * head_size], dim=-1))
    query_start = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    if decode:
        query_start[-1] += 1  # the padding row belongs to the empty last sequence
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_size)
    results = []
    for fused in (False, True):
        c = cache.clone()
        ctx = CudaAttentionContext([(c[0, 0], c[0, 1])], slots, tables, torch.tensor(lens, dtype=torch.int32),
                                   query_start, decode=decode, max_seq_len=24)
        q_run, k_run = q.clone(), k.clone()
        if fused:
            out = ctx.attend_rotary(0, q_run, k_run, v, positions, rotary, scale=0.125, logit_softcap=20.0)
            assert torch.equal(k_run, k), "the fused path leaves k alone"
        else:
            rotary(positions, q_run, k_run)
            out = ctx.attend(0, q_run, k_run, v, scale=0.125, logit_softcap=20.0)
        results.append((out, c, q_run))
    (out_a, cache_a, q_a), (out_b, cache_b, q_b) = results
    assert torch.equal(cache_a, cache_b)
    assert torch.equal(q_a, q_b)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)


def test_attend_with_rotary_prefers_the_context_method() -> None:
    seen = {}

    class Fused:
        def attend(self, *args, **kwargs):
            raise AssertionError("attend_rotary should have been used")

        def attend_rotary(self, layer_idx, q, k, v, positions, rotary, **kwargs):
            seen.update(kwargs, layer_idx=layer_idx, rotary=rotary)
            return q

    q = torch.zeros(2, 1, 4)
    assert attend_with_rotary(Fused(), 1, q, q, q, torch.zeros(2, dtype=torch.int64), "rope", scale=1.0) is q
    assert seen == {"layer_idx": 1, "rotary": "rope", "scale": 1.0, "causal": True, "sliding_window": None,
                    "logit_softcap": None}


# ------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------

SHAPES = [  # head_size, rot_dim, heads, kv_heads
    (64, 64, 14, 2),  # Qwen2.5-0.5B
    (128, 128, 32, 8),  # Llama-3.1-8B
    (80, 80, 5, 5),
    (96, 32, 3, 1),  # partial rotary, 16-byte path
    (64, 24, 7, 3),  # partial rotary whose half (12) is not a multiple of 8: element path
    (256, 128, 8, 4),
]


def _check_against_reference_and_unfused(dtype, neox, shape, block_size, tokens, seed, strided=True):
    head_size, rot_dim, heads, kv_heads = shape
    qkv, q, k, v, cache, slots, pos, table = make_inputs(tokens, heads, kv_heads, head_size, rot_dim, block_size,
                                                         dtype, "cuda", seed)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    k_before = k.clone()
    q_ref, cache_ref = q.clone(), cache.clone()
    reference.rotary_and_cache(pos, q_ref, k, v, cache_ref[0, 0], cache_ref[0, 1], slots, table, neox)
    q_two, k_two, cache_two = q.clone(), k.clone(), cache.clone()
    kernels.rotary_embedding(pos, q_two, k_two, head_size, table, neox)
    kernels.reshape_and_cache(k_two, v, cache_two[0, 0], cache_two[0, 1], slots)
    untouched = cache.clone()
    kernels.rotary_and_cache(pos, q, k, v, cache[0, 0], cache[0, 1], slots, table, neox)
    torch.cuda.synchronize()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(cache, cache_ref, rtol=rtol, atol=atol)
    # Against the two kernels it replaces: the same fp32 math, so at most a last-bit difference.
    torch.testing.assert_close(q, q_two, rtol=ULP[dtype], atol=ULP[dtype])
    torch.testing.assert_close(cache, cache_two, rtol=ULP[dtype], atol=ULP[dtype])
    # Exact where no rotation happens: v, k's pass-through dims, and every slot not written.
    assert torch.equal(cache[0, 1], cache_ref[0, 1])
    assert torch.equal(cache[0, 0, ..., rot_dim:], cache_ref[0, 0, ..., rot_dim:])
    assert torch.equal(q[..., rot_dim:], q_ref[..., rot_dim:])
    written = torch.zeros(cache.shape[2] * block_size, dtype=torch.bool, device="cuda")
    written[slots[slots >= 0]] = True
    written = written.view(cache.shape[2], block_size)
    assert torch.equal(cache[:, :, ~written], untouched[:, :, ~written]), "padding rows must not write"
    assert torch.equal(k, k_before), "k is an input only"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}r{}h{}kv{}".format(*s))
@pytest.mark.parametrize("block_size", [16, 32])
def test_rotary_and_cache_cuda(dtype, neox, shape, block_size) -> None:
    _check_against_reference_and_unfused(dtype, neox, shape, block_size, tokens=37, seed=7)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 200, 1027, 2051])  # 1,024+: several tokens per block, a partial last
def test_rotary_and_cache_cuda_token_counts_and_contiguous_inputs(dtype, tokens) -> None:
    _check_against_reference_and_unfused(dtype, True, (128, 128, 32, 8), 16, tokens, seed=8, strided=False)
    _check_against_reference_and_unfused(dtype, False, (64, 64, 14, 2), 16, tokens, seed=9)


@pytest.mark.cuda
def test_rotary_and_cache_cuda_unaligned_rows_take_the_element_path() -> None:
    """Rows whose head stride is odd cannot move 16 bytes at a time; results must not change."""
    torch.manual_seed(10)
    dtype, tokens, heads, kv_heads, d, bs = torch.bfloat16, 11, 3, 2, 64, 16
    q = torch.randn(tokens, heads, d + 1, device="cuda", dtype=dtype)[..., :d]
    k = torch.randn(tokens, kv_heads, d + 1, device="cuda", dtype=dtype)[..., :d]
    v = torch.randn(tokens, kv_heads, d + 1, device="cuda", dtype=dtype)[..., 1:]
    cache = torch.randn(1, 2, 4, bs, kv_heads, d, device="cuda", dtype=dtype)
    slots = torch.randperm(4 * bs, device="cuda")[:tokens]
    slots[3] = -1
    pos = torch.randint(0, 1000, (tokens,), device="cuda")
    table = kernels.rotary_cos_sin_cache(1024, d).cuda()
    q_ref, cache_ref = q.clone(), cache.clone()
    reference.rotary_and_cache(pos, q_ref, k, v, cache_ref[0, 0], cache_ref[0, 1], slots, table, True)
    kernels.rotary_and_cache(pos, q, k, v, cache[0, 0], cache[0, 1], slots, table, True)
    torch.testing.assert_close(q, q_ref, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(cache, cache_ref, rtol=1.6e-2, atol=1.6e-2)
    assert torch.equal(cache[0, 1], cache_ref[0, 1])


@pytest.mark.cuda
def test_rotary_and_cache_bad_inputs_give_clear_errors() -> None:
    qkv, q, k, v, cache, slots, pos, table = make_inputs(4, 2, 1, 64, 64, 16, torch.float16, "cuda", 11)
    with pytest.raises(ValueError, match="k .* and v .* must be"):
        kernels.rotary_and_cache(pos, q, k[:, :0], v, cache[0, 0], cache[0, 1], slots, table, True)
    with pytest.raises(TypeError, match="int64"):
        kernels.rotary_and_cache(pos.int(), q, k, v, cache[0, 0], cache[0, 1], slots, table, True)
    with pytest.raises(ValueError, match="rot_dim"):
        kernels.rotary_and_cache(pos, q, k, v, cache[0, 0], cache[0, 1], slots, table.repeat(1, 2)[:, :66], True)
    with pytest.raises(ValueError, match="dtype"):
        kernels.rotary_and_cache(pos, q.float(), k, v, cache[0, 0], cache[0, 1], slots, table, True)


@pytest.mark.cuda
@pytest.mark.parametrize("neox", [True, False])
def test_rotary_and_cache_inside_cuda_graph(neox: bool) -> None:
    """Captured once; replayed with new q/k/v, positions and slots (padding rows included), then the
    decode kernel reads the keys the fused kernel wrote, as the engine's graph does."""
    torch.manual_seed(12)
    dtype, tokens, heads, kv_heads, d, bs, num_blocks = torch.bfloat16, 8, 14, 2, 64, 16, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device="cuda", dtype=dtype)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    cache = torch.randn(1, 2, num_blocks, bs, kv_heads, d, device="cuda", dtype=dtype)
    pos = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    slots = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")
    tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32)[: tokens * 5].view(tokens, 5)
    lens = torch.ones(tokens, dtype=torch.int32, device="cuda")
    table = kernels.rotary_cos_sin_cache(4096, d, 1e6).cuda()
    max_len = 5 * bs
    workspace = torch.empty(kernels.decode_workspace_size(tokens, heads, kv_heads, d, max_len, 0) // 4 + 1,
                            device="cuda")

    def step() -> torch.Tensor:
        kernels.rotary_and_cache(pos, q, k, v, cache[0, 0], cache[0, 1], slots, table, neox)
        return kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, d**-0.5,
                                              max_seq_len=max_len, workspace=workspace)

    graph, out = capture_graph(step)
    for trial in range(3):
        seq_lens = torch.randint(1, max_len + 1, (tokens,), device="cuda")
        seq_lens[trial] = 0  # a padding row
        lens.copy_(seq_lens.int())
        p = (seq_lens - 1).clamp(min=0)
        pos.copy_(p)
        new_slots = tables.long().gather(1, (p // bs)[:, None])[:, 0] * bs + p % bs
        slots.copy_(torch.where(seq_lens > 0, new_slots, torch.full_like(new_slots, -1)))
        qkv.copy_(torch.randn_like(qkv))
        q_ref, cache_ref = q.clone(), cache.clone()
        reference.rotary_and_cache(pos, q_ref, k, v, cache_ref[0, 0], cache_ref[0, 1], slots, table, neox)
        want = reference.paged_decode_attention(q_ref, cache_ref[0, 0], cache_ref[0, 1], tables, lens, d**-0.5)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(q, q_ref, rtol=1.6e-2, atol=1.6e-2, msg=lambda m, t=trial: f"replay {t}: {m}")
        torch.testing.assert_close(cache, cache_ref, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_cuda_context_fused_override_on_gpu() -> None:
    """CudaAttentionContext.attend_rotary on the GPU equals rotary + attend (prefill path)."""
    torch.manual_seed(13)
    rotary = RotaryEmbedding(_config(128, 128))
    tokens, heads, kv_heads, d, bs = 21, 4, 2, 128, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.float16)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    positions = torch.arange(tokens, device="cuda")
    tables = torch.tensor([[3, 0]], dtype=torch.int32, device="cuda")
    slots = tables.long()[0, positions // bs] * bs + positions % bs
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    cache = torch.zeros(1, 2, 4, bs, kv_heads, d, device="cuda", dtype=torch.float16)
    outs = []
    for fused in (False, True):
        c = cache.clone()
        ctx = CudaAttentionContext([(c[0, 0], c[0, 1])], slots, tables, lens, qsl, decode=False, max_seq_len=32)
        q_run, k_run = q.clone(), k.clone()
        if fused:
            out = ctx.attend_rotary(0, q_run, k_run, v, positions, rotary, scale=d**-0.5)
        else:
            rotary(positions, q_run, k_run)
            out = ctx.attend(0, q_run, k_run, v, scale=d**-0.5)
        outs.append((out, c))
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=2e-3, atol=2e-3)
