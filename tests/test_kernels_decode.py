"""Decode-path kernels: KV write, block copy, paged decode attention, gated activations.

References against float64 math and the engine's PyTorch paged attention on the CPU (CI); CUDA
kernels against the references under -m cuda, including inside a captured CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from wllm import kernels
from wllm.engine.cuda_graphs import capture_graph
from wllm.engine.paged_attention import PagedAttentionContext, allocate_kv_cache
from wllm.kernels import ops, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
HEAD_SIZES = [64, 80, 96, 128, 256]
UNUSED = 2**30  # block-table entries past a sequence's blocks: a kernel that reads them faults


@pytest.fixture(params=["mma", "fma"])
def decode_kernel(request):
    """Runs a CUDA decode-attention test on the tensor-core kernels (small batches included) and again on
    the FMA kernel (the one sm_7x GPUs, fp32 and head size 256 use); the default mixes the two by batch
    size. The switch only changes anything where both apply."""
    previous = kernels.set_decode_mma(request.param == "mma", small_batch=True)
    yield request.param
    kernels.set_decode_mma(previous)  # back to the default mode (small batches on the FMA kernel)


@pytest.fixture(params=["persistent", "per-cta", "off"])
def tma_mode(request):
    """Runs a wide-grid CUDA test with decode attention's K/V tiles by TMA on the persistent kernel (the
    default for calls without splits), on one CTA per sequence and KV head, and by per-row bulk copies.
    The switch only changes anything on SM 9.0, for head sizes 64 and 128 without a sliding window."""
    previous = kernels.set_decode_tma(request.param)
    yield request.param
    kernels.set_decode_tma(previous)


def make_paged(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Random q, a one-layer engine cache [1, 2, NB, BS, Hkv, D] and scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(needed + [1]) + 1
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), UNUSED, dtype=torch.int32)
    for s, n in enumerate(needed):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.randn(1, 2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(device), cache.to(device), tables.to(device), lens.to(device)


def poison_free_slots(cache: torch.Tensor, tables: torch.Tensor, lens: list[int]) -> None:
    """NaN into every slot of a make_paged cache that no sequence owns (past each context in its last
    block, and unused blocks)."""
    block_size = cache.shape[3]
    n = torch.tensor(lens, dtype=torch.int64, device=tables.device)
    pos = torch.arange(max(lens + [1]), device=tables.device)
    live = pos[None, :] < n[:, None]  # [seqs, positions]
    blocks = tables.long().gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1).expand(len(lens), -1))
    owned = torch.zeros(cache.shape[2], block_size, dtype=torch.bool, device=tables.device)
    owned[blocks[live], (pos % block_size).expand(len(lens), -1)[live]] = True
    cache[0, :, ~owned.to(cache.device)] = float("nan")


def decode64(q, key_cache, value_cache, tables, lens, scale, window=0, softcap=0.0) -> torch.Tensor:
    """Decode attention from first principles in float64, one sequence and head at a time."""
    num_seqs, num_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lens[s])
        lo = max(0, n - window) if window else 0
        for h in range(num_heads):
            kh = h // group
            keys = torch.stack([key_cache[int(tables[s, p // block_size]), p % block_size, kh] for p in range(lo, n)]
                               ) if n else None
            if keys is None:
                continue
            vals = torch.stack([value_cache[int(tables[s, p // block_size]), p % block_size, kh]
                                for p in range(lo, n)])
            scores = keys.double() @ q[s, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[s, h] = torch.softmax(scores, 0) @ vals.double()
    return out


# ------------------------------------------------------------------------------------------
# References (CPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 4, 4), (80, 28, 4), (128, 8, 2), (256, 2, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_vs_float64(dtype, head_size, num_heads, num_kv_heads, block_size) -> None:
    q, cache, tables, lens = make_paged([0, 1, 17, 45, 33], num_heads, num_kv_heads, head_size, block_size, dtype)
    scale = head_size**-0.5
    out = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    want = decode64(q, cache[0, 0], cache[0, 1], tables, lens, scale)
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])
    assert torch.count_nonzero(out[0]) == 0  # the empty (padding) sequence


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (0, 5.0), (20, 30.0)])
def test_decode_reference_window_softcap_vs_float64(window: int, softcap: float) -> None:
    q, cache, tables, lens = make_paged([3, 19, 60], 8, 2, 64, 16, torch.float32, seed=1)
    out = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.3, window, softcap)
    want = decode64(q, cache[0, 0], cache[0, 1], tables, lens, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_decode_reference_matches_engine_paged_attention() -> None:
    """The kernels' reference and the engine's CPU attention agree on the engine's cache layout."""
    torch.manual_seed(2)
    num_layers, num_blocks, block_size, num_kv_heads, head_size, num_heads = 2, 12, 16, 2, 64, 8
    cache = allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_size, torch.float32, "cpu")
    cache.copy_(torch.randn_like(cache))
    block_tables, lens = [[3, 7], [11], [0, 5, 9]], [20, 16, 33]
    ctx = PagedAttentionContext(cache, block_tables, [n - 1 for n in lens], [1] * 3)
    q = torch.randn(3, num_heads, head_size)
    k, v = torch.randn(3, num_kv_heads, head_size), torch.randn(3, num_kv_heads, head_size)
    want = ctx.attend(1, q, k, v, scale=0.125, sliding_window=10)  # also writes k/v into the cache
    tables = torch.tensor([t + [0] * (3 - len(t)) for t in block_tables], dtype=torch.int32)
    got = kernels.paged_decode_attention(q, cache[1, 0], cache[1, 1], tables, torch.tensor(lens, dtype=torch.int32),
                                         0.125, sliding_window=10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_reference_ignores_nan_in_free_slots(block_size: int) -> None:
    # The batch is padded to its longest sequence, so shorter ones gather slots they do not own.
    lens = [1, 5, 17, 40, 0]
    q, cache, tables, lens_t = make_paged(lens, 8, 2, 64, block_size, torch.float32, "cpu", 4)
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.125, sliding_window=12)
    poison_free_slots(cache, tables, lens)
    got = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.125, sliding_window=12)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want)


def test_reshape_and_cache_reference() -> None:
    torch.manual_seed(3)
    cache = torch.zeros(1, 2, 6, 16, 2, 64)
    qkv = torch.randn(5, 6 * 64)  # [T, (Hq + 2 Hkv) * D]: k and v are strided slices
    key, value = qkv[:, 2 * 64 : 4 * 64], qkv[:, 4 * 64 :]
    slots = torch.tensor([17, -1, 0, 95, 40])
    kernels.reshape_and_cache(key, value, cache[0, 0], cache[0, 1], slots)
    flat_k, flat_v = cache[0, 0].reshape(-1, 2, 64), cache[0, 1].reshape(-1, 2, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t].view(2, 64)) and torch.equal(flat_v[slot], value[t].view(2, 64))
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(96) if s not in written]
    assert torch.count_nonzero(flat_k[untouched]) == 0 and torch.count_nonzero(flat_v[untouched]) == 0


def test_copy_blocks_reference_engine_layout() -> None:
    torch.manual_seed(4)
    src = torch.randn(3, 2, 8, 4, 2, 8)
    dst = torch.zeros(3, 2, 5, 4, 2, 8)
    pairs = torch.tensor([[7, 0], [2, 3], [3, 4]])
    kernels.copy_blocks(src, dst, pairs)
    for s, d in pairs.tolist():
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert torch.count_nonzero(dst[:, :, [1, 2]]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_and_mul_reference_vs_float64(dtype: torch.dtype, activation: str) -> None:
    torch.manual_seed(5)
    x = (torch.randn(7, 2 * 37) * 3).to(dtype)
    g, u = x[:, :37].double(), x[:, 37:].double()
    if activation == "silu":
        want = g / (1 + torch.exp(-g)) * u
    else:
        want = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    out = kernels.act_and_mul(x, activation)
    assert out.dtype == dtype and out.shape == (7, 37)
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_decode_custom_ops_pass_opcheck() -> None:
    q, cache, tables, lens = make_paged([5, 0, 20], 4, 2, 64, 16, torch.float32, seed=6)
    tables = tables.clamp(max=cache.shape[2] - 1)
    torch.library.opcheck(torch.ops.wllm.paged_decode_attention.default,
                          (q, cache[0, 0], cache[0, 1], tables, lens, 0.125, 64, 0, 0.0, 0))
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    torch.library.opcheck(torch.ops.wllm.reshape_and_cache.default,
                          (k, v, cache[0, 0].clone(), cache[0, 1].clone(), torch.tensor([1, -1, 40])))
    torch.library.opcheck(torch.ops.wllm.act_and_mul.default, (torch.randn(3, 10), "silu"))
    torch.library.opcheck(torch.ops.wllm.copy_blocks.default,
                          (cache.clone(), cache.clone(), torch.tensor([[0, 1]]), 2))


def test_decode_bad_inputs_give_clear_errors() -> None:
    q, cache, tables, lens = make_paged([5], 4, 3, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 1.0)
    q, cache, tables, lens = make_paged([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="unknown activation"):
        kernels.act_and_mul(torch.randn(2, 8), "relu")


# ------------------------------------------------------------------------------------------
# CUDA kernels vs references (GPU machine)
# ------------------------------------------------------------------------------------------

LENS = [0, 1, 15, 16, 17, 100, 513, 1000, 33]  # padding row, block edges, several tiles


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (14, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_cuda(dtype, head_size, num_heads, num_kv_heads, block_size) -> None:
    q, cache, tables, lens = make_paged(LENS, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda", seed=7)
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale)
    for splits in (0, 1, 3, 64):  # automatic, never, a few, more than the shortest contexts fill
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale, num_splits=splits)
        for s, n in enumerate(LENS):
            torch.testing.assert_close(got[s], want[s], rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                       msg=lambda m, s=s, n=n, k=splits: f"splits={k} seq {s} (len {n}): {m}")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(128, 32, 2), (64, 24, 3), (256, 8, 1), (96, 10, 2)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 0.0), (0, 30.0), (37, 50.0)])
def test_paged_decode_cuda_large_groups_window_softcap(dtype, head_size, num_heads, num_kv_heads, window,
                                                       softcap) -> None:
    q, cache, tables, lens = make_paged([700, 0, 99, 1], num_heads, num_kv_heads, head_size, 16, dtype, "cuda", 8)
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.1, window, softcap)
    for splits in (0, 1, 2):
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.1, sliding_window=window,
                                             logit_softcap=softcap, num_splits=splits)
        torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                   msg=lambda m, k=splits: f"splits={k}: {m}")


@pytest.mark.usefixtures("tma_mode")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(128, 32, 8), (64, 16, 16), (96, 24, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 30.0)])
def test_paged_decode_cuda_wide_grid(dtype, head_size, num_heads, num_kv_heads, block_size, window, softcap) -> None:
    """A batch of 8+ CTAs per SM (the offline batch's regime: many CTAs resident at once and several
    waves): contexts empty, under one tile, around tile and block edges, and long, in scattered blocks;
    automatic and forced splits; sliding window with soft-capping."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_seqs = -(-8 * sms // num_kv_heads) + 5  # the group fits one CTA (<= 8 query heads per KV head)
    pattern = [0, 1, 15, 16, 17, 63, 64, 65, 129, 300, 511, 700]
    lens = [pattern[i % len(pattern)] for i in range(num_seqs)]
    q, cache, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda", 21)
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale, window, softcap)
    for splits in (0, 3):
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale, sliding_window=window,
                                             logit_softcap=softcap, num_splits=splits)
        torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                   msg=lambda m, k=splits: f"splits={k}: {m}")


@pytest.mark.usefixtures("tma_mode")
@pytest.mark.cuda
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(128, 32, 8), (64, 16, 16)])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_paged_decode_cuda_wide_grid_nan_in_free_slots(head_size, num_heads, num_kv_heads, block_size) -> None:
    """The wide-grid regime (on sm_90: K/V tiles by TMA boxes, which copy whole cache blocks) with NaN in
    every cache slot no sequence owns: past each context in its last block, and in unused blocks. Rows past
    the context must never reach the output (0 * NaN is NaN)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_seqs = -(-8 * sms // num_kv_heads) + 3
    pattern = [1, 5, 31, 32, 33, 47, 64, 100, 257]
    lens = [pattern[i % len(pattern)] for i in range(num_seqs)]
    q, cache, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, block_size, torch.bfloat16,
                                          "cuda", 23)
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale)
    poison_free_slots(cache, tables, lens)
    for splits in (0, 3):
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale, num_splits=splits)
        assert not torch.isnan(got).any(), f"splits={splits}: NaN from a free slot"
        torch.testing.assert_close(got, want, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1],
                                   msg=lambda m, k=splits: f"splits={k}: {m}")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
def test_paged_decode_cuda_strided_q_and_out() -> None:
    """q as a slice of a fused qkv buffer and a strided output view."""
    q, cache, tables, lens = make_paged([40, 300], 8, 2, 128, 16, torch.bfloat16, "cuda", 9)
    qkv = torch.randn(2, 12, 128, device="cuda", dtype=torch.bfloat16)
    qkv[:, :8] = q
    out_buf = torch.zeros(2, 16, 128, device="cuda", dtype=torch.bfloat16)
    got = kernels.paged_decode_attention(qkv[:, :8], cache[0, 0], cache[0, 1], tables, lens, 0.08, out=out_buf[:, 4:12])
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.08)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(out_buf[:, :4]) == 0 and torch.count_nonzero(out_buf[:, 12:]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_cuda(dtype, head_size, block_size) -> None:
    torch.manual_seed(10)
    kv_heads, tokens, num_blocks = 3, 29, 9
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_size, device="cuda").to(dtype)
    qkv = torch.randn(tokens, (5 + 2 * kv_heads) * head_size, device="cuda").to(dtype)
    key = qkv[:, 5 * head_size : (5 + kv_heads) * head_size]
    value = qkv[:, (5 + kv_heads) * head_size :]
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slots[::5] = -1  # graph padding rows
    want = cache.clone()
    reference.reshape_and_cache(key.reshape(tokens, kv_heads, head_size), value.reshape(tokens, kv_heads, head_size),
                                want[0, 0], want[0, 1], slots)
    kernels.reshape_and_cache(key, value, cache[0, 0], cache[0, 1], slots)
    assert torch.equal(cache, want)
    # Unaligned rows (odd head stride) take the scalar path.
    odd = torch.randn(tokens, kv_heads, head_size + 1, device="cuda").to(dtype)[..., :head_size]
    want2 = cache.clone()
    reference.reshape_and_cache(odd, odd, want2[0, 0], want2[0, 1], slots)
    kernels.reshape_and_cache(odd, odd, cache[0, 0], cache[0, 1], slots)
    assert torch.equal(cache, want2)


@pytest.mark.cuda
@pytest.mark.parametrize("direction", ["gpu->cpu", "cpu->gpu", "gpu->gpu"])
def test_copy_blocks_cuda(direction: str) -> None:
    torch.manual_seed(11)
    shape = (4, 2, 10, 16, 2, 64)
    src_dev, dst_dev = direction.replace("gpu", "cuda").split("->")
    src = torch.randn(shape).to(torch.bfloat16)
    src = src.pin_memory() if src_dev == "cpu" else src.cuda()
    dst = torch.zeros(4, 2, 7, 16, 2, 64, dtype=torch.bfloat16)
    dst = dst.pin_memory() if dst_dev == "cpu" else dst.cuda()
    pairs = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 6], [0, 4]])  # one run of three, then scattered
    want = dst.cpu().clone()
    reference.copy_blocks(src.cpu(), want, pairs)
    kernels.copy_blocks(src, dst, pairs)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)
    with pytest.raises(kernels.KernelError, match="outside the caches"):
        kernels.copy_blocks(src, dst, torch.tensor([[0, 7]]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,inter", [(1, 64), (7, 37), (33, 4096), (3, 11008)])
def test_act_and_mul_cuda(dtype, activation, rows, inter) -> None:
    torch.manual_seed(12)
    x = (torch.randn(rows, 2 * inter, device="cuda") * 2).to(dtype)
    torch.testing.assert_close(kernels.act_and_mul(x, activation), reference.act_and_mul(x, activation),
                               rtol=TOL[dtype][0], atol=TOL[dtype][1])
    xs = x[::2]  # strided rows
    torch.testing.assert_close(kernels.act_and_mul(xs, activation), reference.act_and_mul(xs, activation),
                               rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [0, 1])
def test_kv_write_and_decode_inside_cuda_graph(num_splits: int) -> None:
    """Captured once at the maximum context; replayed with other lengths, tables and inputs."""
    torch.manual_seed(13)
    dtype, num_seqs, num_heads, kv_heads, head_size, block_size = torch.bfloat16, 6, 16, 4, 128, 16
    max_blocks, num_blocks = 64, 6 * 64 + 1
    max_seq_len = max_blocks * block_size
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_size, device="cuda", dtype=dtype)
    q = torch.randn(num_seqs, num_heads, head_size, device="cuda", dtype=dtype)
    k = torch.randn(num_seqs, kv_heads, head_size, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    slots = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    workspace = torch.zeros(ops.decode_workspace_size(num_seqs, num_heads, kv_heads, head_size, max_seq_len,
                                                      num_splits) // 4 + 1, device="cuda")

    def step() -> torch.Tensor:
        kernels.reshape_and_cache(k, v, cache[0, 0], cache[0, 1], slots)
        return kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.09,
                                              max_seq_len=max_seq_len, num_splits=num_splits, workspace=workspace)

    graph, out = capture_graph(step)
    for trial, seq_lens in enumerate([[1, 17, 1024, 0, 300, 5], [1000, 2, 0, 0, 64, 513], [0] * 6]):
        perm = torch.randperm(num_blocks - 1, device="cuda")[: num_seqs * max_blocks].view(num_seqs, max_blocks)
        tables.copy_(perm.int())
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        pos = (lens.long() - 1).clamp(min=0)
        new_slots = tables.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
        slots.copy_(torch.where(lens > 0, new_slots, torch.full_like(new_slots, -1)))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        cache_ref = cache.clone()
        reference.reshape_and_cache(k, v, cache_ref[0, 0], cache_ref[0, 1], slots)
        want = reference.paged_decode_attention(q, cache_ref[0, 0], cache_ref[0, 1], tables, lens, 0.09)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, cache_ref), f"replay {trial}: KV write"
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2, msg=lambda m, t=trial: f"replay {t}: {m}")


TICKET_WORDS = 4096  # the fused split merge's tickets at the start of the workspace (csrc/attention_decode.cu)


def zeroed_workspace(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, max_seq_len: int,
                     num_splits: int = 0) -> torch.Tensor:
    size = ops.decode_workspace_size(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len, num_splits)
    return torch.zeros(size // 4 + 1, device="cuda")


def assert_tickets_zero(workspace: torch.Tensor, what: str = "") -> None:
    """Every call must leave its tickets at zero, or the next call (or graph replay) merges too early."""
    tickets = workspace[:TICKET_WORDS].view(torch.int32) if workspace.numel() >= TICKET_WORDS else workspace
    assert torch.count_nonzero(tickets) == 0, f"{what}: split-merge tickets left non-zero"


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 14, 2), (128, 32, 8), (80, 5, 5), (256, 8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_paged_decode_cuda_odd_contexts_big_graph_max(dtype, head_size, num_heads, num_kv_heads, block_size) -> None:
    """Contexts around tile, block and split edges under a graph-sized max_seq_len (8192), with the
    automatic split (fused merge), no split, and forced splits (some sequences shorter than one split)."""
    lens = [1, 17, 129, 1000, 4097, 0, 95, 96, 97]
    q, cache, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda", 14)
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale)
    for splits in (0, 1, 2, 7, 64):
        workspace = zeroed_workspace(len(lens), num_heads, num_kv_heads, head_size, 8192, splits)
        for repeat in range(2):  # the second call finds the tickets the first one left
            got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale, max_seq_len=8192,
                                                 num_splits=splits, workspace=workspace)
            for s, n in enumerate(lens):
                torch.testing.assert_close(got[s], want[s], rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                           msg=lambda m, s=s, n=n, k=splits, r=repeat: f"splits={k} call {r} seq {s} "
                                                                                        f"(len {n}): {m}")
            assert_tickets_zero(workspace, f"splits={splits}")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 14, 2), (128, 32, 8)])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_paged_decode_fused_merge_inside_cuda_graph(head_size, num_heads, num_kv_heads, num_seqs) -> None:
    """The latency path as the engine runs it: one graph captured for max_seq_len 8192 at batch 1 or 3
    (many splits, the merge fused into the last CTA), replayed with lengths that use one, a few and many
    splits, then empty rows, then long ones again; tickets must be zero after every replay."""
    torch.manual_seed(15)
    dtype, block_size, max_seq_len = torch.bfloat16, 16, 8192
    max_blocks = max_seq_len // block_size
    num_blocks = num_seqs * max_blocks + 1
    cache = torch.randn(1, 2, num_blocks, block_size, num_kv_heads, head_size, device="cuda", dtype=dtype)
    q = torch.randn(num_seqs, num_heads, head_size, device="cuda", dtype=dtype)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.ones(num_seqs, dtype=torch.int32, device="cuda")
    workspace = zeroed_workspace(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len)
    assert workspace.numel() > TICKET_WORDS  # this shape does split

    def step() -> torch.Tensor:
        return kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, head_size**-0.5,
                                              max_seq_len=max_seq_len, workspace=workspace)

    graph, out = capture_graph(step)
    trials = [[128, 512, 1], [1, 17, 129], [4097, 1000, 8192], [0, 0, 0], [400, 0, 8000], [129, 129, 129],
              [5000, 3, 64]]
    for trial, seq_lens in enumerate(trials):
        seq_lens = seq_lens[:num_seqs]
        perm = torch.randperm(num_blocks - 1, device="cuda")[: num_seqs * max_blocks].view(num_seqs, max_blocks)
        tables.copy_(perm.int())
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))  # stale output must not survive a replay
        want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, head_size**-0.5)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, t=trial, n=seq_lens: f"replay {t} lens {n}: {m}")
        assert_tickets_zero(workspace, f"replay {trial}")


@pytest.mark.cuda
def test_paged_decode_workspace_shared_by_calls_of_other_sizes() -> None:
    """One zeroed workspace sized for the largest call serves smaller and larger batches in any order (as
    the engine's graphs and eager steps share it): partials of one size never land on another's tickets."""
    num_heads, num_kv_heads, head_size, max_seq_len = 8, 2, 128, 4096
    sizes = [1, 64, 2, 300, 8, 1]
    workspace = torch.zeros(max(ops.decode_workspace_size(b, num_heads, num_kv_heads, head_size, max_seq_len)
                                for b in sizes) // 4 + 1, device="cuda")
    for i, b in enumerate(sizes):
        longest = 3000 if b <= 64 else 200  # keeps the random cache small
        lens = [(97 * (i + 1) * (s + 3)) % longest + 1 for s in range(b)]
        q, cache, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, 16, torch.bfloat16, "cuda",
                                              seed=16 + i)
        want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.1)
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.1,
                                             max_seq_len=max_seq_len, workspace=workspace)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m, b=b: f"batch {b}: {m}")
        assert_tickets_zero(workspace, f"batch {b}")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
def test_paged_decode_separate_merge_when_tickets_do_not_fit() -> None:
    """More (sequence, KV head) pairs than tickets with a forced split: the second merge kernel runs
    instead of the fused merge, and still leaves short sequences (written by the main kernel) alone."""
    num_seqs, num_heads, num_kv_heads, head_size = 520, 8, 8, 64  # 4,160 pairs > 4,096 tickets
    lens = [(s * 37) % 200 for s in range(num_seqs)]  # includes 0 and lengths shorter than one split
    q, cache, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, 16, torch.float16, "cuda", 17)
    want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.125)
    workspace = zeroed_workspace(num_seqs, num_heads, num_kv_heads, head_size, 512, 4)
    got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.125, max_seq_len=512,
                                         num_splits=4, workspace=workspace)
    torch.testing.assert_close(got, want, rtol=4e-3, atol=4e-3)
    assert_tickets_zero(workspace, "separate merge")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 14, 2), (128, 32, 8), (256, 8, 1), (80, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_single_pass_edges_inside_cuda_graph(head_size, num_heads, num_kv_heads, dtype) -> None:
    """Batch 1 in a graph captured for max_seq_len 4096 (many grid splits): contexts either side of the
    span below which one CTA per KV head does the whole sequence (no partials, no merge) -- one split unit
    plus two tiles: 48, 64 or 96 tokens for the bf16 layouts here -- and of two and many splits; every
    replay must match the reference and leave the tickets at zero."""
    torch.manual_seed(18)
    block_size, max_seq_len = 16, 4096
    max_blocks = max_seq_len // block_size
    cache = torch.randn(1, 2, max_blocks + 1, block_size, num_kv_heads, head_size, device="cuda").to(dtype)
    q = torch.randn(1, num_heads, head_size, device="cuda").to(dtype)
    tables = torch.zeros(1, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    workspace = zeroed_workspace(1, num_heads, num_kv_heads, head_size, max_seq_len)
    scale = head_size**-0.5

    def step() -> torch.Tensor:
        return kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale,
                                              max_seq_len=max_seq_len, workspace=workspace)

    graph, out = capture_graph(step)
    for n in [1, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95, 96, 97, 128, 129, 160, 161, 257, 512, 640, 1000, 4096]:
        tables.copy_(torch.randperm(max_blocks, device="cuda")[None].int())
        lens.fill_(n)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                   msg=lambda m, n=n: f"context {n}: {m}")
        assert_tickets_zero(workspace, f"context {n}")


@pytest.mark.usefixtures("decode_kernel")
@pytest.mark.usefixtures("tma_mode")
@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_decode_block_table_windows(block_size: int) -> None:
    """Block ids go through shared memory in windows of 128 table entries: one long sequence per CTA (no
    split) crosses several windows, with a sliding window whose start is not block aligned and a context
    that ends one token into a new window; the medium-context batch shape (many sequences of 512-640
    tokens, the throughput workload) in the same call."""
    lens = [128 * block_size * 3 + 1, 128 * block_size + 1, 5000] + [512 + (37 * s) % 129 for s in range(40)]
    q, cache, tables, lens_t = make_paged(lens, 32, 8, 128, block_size, torch.bfloat16, "cuda", 19)
    for window in (0, 1500):
        want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.1, window)
        for splits in (0, 1):
            got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, 0.1, max_seq_len=8192,
                                                 sliding_window=window, num_splits=splits)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2,
                                       msg=lambda m, w=window, k=splits: f"window {w} splits {k}: {m}")


@pytest.mark.usefixtures("tma_mode")
@pytest.mark.cuda
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(128, 32, 8), (64, 14, 2), (128, 32, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_many_units_per_cta_inside_cuda_graph(head_size, num_heads, num_kv_heads, block_size,
                                                           dtype) -> None:
    """Several times more (sequence, KV head) units than resident CTAs, so that the persistent kernel's CTAs
    stream many units each through their stages (stage phases wrapping across units, empty and one-token
    contexts between long ones, tiles ending inside a block; 32 / 2 heads: two chunks of 8 query heads per
    KV head); captured once in a graph and replayed with new lengths, block tables and q, with NaN in every
    free cache slot."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_seqs = -(-24 * sms // num_kv_heads)
    max_seq_len = 320
    max_blocks = -(-max_seq_len // block_size)
    num_blocks = num_seqs * max_blocks + 1
    gen = torch.Generator().manual_seed(31)
    cache = torch.randn(1, 2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    clean = cache.clone()
    q = torch.empty(num_seqs, num_heads, head_size, device="cuda", dtype=dtype)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    scale = head_size**-0.5

    def step() -> torch.Tensor:
        return kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale, max_seq_len=max_seq_len,
                                              num_splits=1)

    graph, out = capture_graph(step)
    for replay in range(3):
        n = torch.randint(0, max_seq_len + 1, (num_seqs,), generator=gen)
        n[replay::7] = 0
        n[replay + 1::11] = 1
        n[replay + 2::13] = max_seq_len
        order = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
        tables.copy_(order.int())
        lens.copy_(n.int())
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        cache.copy_(clean)
        want = reference.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, scale)
        poison_free_slots(cache, tables, n.tolist())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"replay {replay}: NaN in the output"
        torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1],
                                   msg=lambda m, r=replay: f"replay {r}: {m}")


@pytest.mark.cuda
def test_paged_decode_rejects_unaligned_workspace() -> None:
    q, cache, tables, lens = make_paged([300], 8, 2, 64, 16, torch.bfloat16, "cuda", 20)
    need = ops.decode_workspace_size(1, 8, 2, 64, 4096)
    assert need > 0
    workspace = torch.zeros(need // 4 + 2, device="cuda")[1:]  # 4 bytes past a 16-byte boundary
    with pytest.raises(kernels.KernelError, match="16-byte aligned"):
        kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens, 0.1, max_seq_len=4096,
                                       workspace=workspace)


@pytest.mark.cuda
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(128, 32, 8), (64, 16, 16)])
def test_paged_decode_same_storage_other_layout(head_size, num_heads, num_kv_heads) -> None:
    """One cache storage viewed with block size 16 and then as twice the blocks of 8 (same base pointer,
    other block size and strides), then with 16 again: the TMA descriptors the library keeps per cache
    layout must follow the layout, not the pointer."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    num_seqs = -(-8 * sms // num_kv_heads)
    lens = [(37 * s) % 300 + 1 for s in range(num_seqs)]
    q, cache16, tables16, lens_t = make_paged(lens, num_heads, num_kv_heads, head_size, 16, torch.bfloat16, "cuda", 33)
    num_blocks = cache16.shape[2]
    cache8 = cache16.view(1, 2, num_blocks * 2, 8, num_kv_heads, head_size)
    assert cache8.data_ptr() == cache16.data_ptr()
    # Block b of 16 rows is blocks 2b and 2b + 1 of 8 rows.
    tables8 = torch.stack([tables16 * 2, tables16 * 2 + 1], dim=2).flatten(1)
    tables8[tables16.repeat_interleave(2, dim=1) == UNUSED] = UNUSED
    scale = head_size**-0.5
    want = reference.paged_decode_attention(q, cache16[0, 0], cache16[0, 1], tables16, lens_t, scale)
    for cache, tables in ((cache16, tables16), (cache8, tables8), (cache16, tables16)):
        got = kernels.paged_decode_attention(q, cache[0, 0], cache[0, 1], tables, lens_t, scale)
        torch.testing.assert_close(got, want, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1],
                                   msg=lambda m, bs=cache.shape[3]: f"block size {bs}: {m}")
