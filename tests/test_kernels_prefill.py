"""Paged prefill attention: the reference against float64 math and the engine's gather path (CPU, CI);
the CUDA kernel against the reference (-m cuda) on odd, mixed batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from wllm import kernels
from wllm.engine.paged_attention import PagedAttentionContext
from wllm.kernels import reference

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(params=["default", "mma_sync"])
def prefill_kernel(request):
    """Runs a CUDA test on the default kernel (on SM 9.0 the Hopper wgmma one for head sizes 64 and 128)
    and, on SM 9.0, again on the mma.sync kernel the other tensor-core GPUs run."""
    if request.param == "default":
        yield request.param
        return
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the mma.sync kernel is already the default on this GPU")
    previous = kernels.set_prefill_sm90(False)
    yield request.param
    kernels.set_prefill_sm90(previous)


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    q_lens: list[int]
    ctx_lens: list[int]
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D], what the cache holds


def make_case(q_lens: list[int], prefix: list[int], num_heads: int, num_kv_heads: int, head_size: int,
              block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
              poison: bool = False) -> Case:
    """A batch whose sequence s has prefix[s] cached tokens plus q_lens[s] new ones, with blocks
    scattered over a cache larger than needed. With poison, every slot that is not part of some
    context (block tails, spare blocks, table padding) holds NaN, so reading one shows up."""
    gen = torch.Generator().manual_seed(seed)
    ctx_lens = [p + n for p, n in zip(prefix, q_lens)]
    blocks_needed = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm.pop()  # table padding points here
    fill = float("nan") if poison else 0.0
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    max_blocks = max(blocks_needed + [1]) + 2
    tables = torch.full((len(q_lens), max_blocks), spare, dtype=torch.int32)
    keys = []
    for s, ctx in enumerate(ctx_lens):
        ids = [perm.pop() for _ in range(blocks_needed[s])]
        tables[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        slots = (torch.tensor(ids)[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:ctx]
        k_cache.view(-1, num_kv_heads, head_size)[slots] = k
        v_cache.view(-1, num_kv_heads, head_size)[slots] = v
        keys.append(k)
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return Case(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                torch.tensor(ctx_lens, dtype=torch.int32, device=device), qsl.to(device), q_lens, ctx_lens, keys)


def attention64(case: Case, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """float64, one query at a time, from the cache contents through the block table by hand."""
    q = case.q.cpu().double()
    k_cache, v_cache = case.k_cache.cpu().double(), case.v_cache.cpu().double()
    tables = case.block_tables.cpu().tolist()
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.zeros_like(q)
    row = 0
    for s, (n, ctx) in enumerate(zip(case.q_lens, case.ctx_lens)):
        keys = torch.stack([k_cache[tables[s][j // bs], j % bs] for j in range(ctx)])
        values = torch.stack([v_cache[tables[s][j // bs], j % bs] for j in range(ctx)])
        for i in range(n):
            pos = ctx - n + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                scores = keys[lo : pos + 1, h // group] @ q[row + i, h] * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[row + i, h] = torch.softmax(scores, 0) @ values[lo : pos + 1, h // group]
        row += n
    return out


# ------------------------------------------------------------------------------------------
# Reference (CPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1), (7, 1)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 20.0), (6, 10.0)])
def test_reference_vs_float64(dtype: torch.dtype, heads: int, kv_heads: int, window: int, softcap: float) -> None:
    # One prompt, one chunk after a prefix hit, one decode token, one empty row, odd block tails.
    case = make_case([9, 4, 1, 0, 3], [0, 13, 20, 3, 0], heads, kv_heads, 16, 4, dtype, seed=1)
    scale = 16**-0.5
    out = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                            case.query_start_loc, scale, window, softcap)
    assert out.dtype == dtype and out.shape == case.q.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), attention64(case, scale, window, softcap), rtol=rtol, atol=atol)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_engine_gather_path(window: int | None) -> None:
    """Same masking and position rules as PagedAttentionContext.attend (prefill, chunk, decode)."""
    torch.manual_seed(2)
    heads, kv_heads, d, bs = 4, 2, 8, 4
    start_pos, num_new = [0, 7, 11], [6, 5, 1]
    tables = [[3, 0], [5, 1, 6], [2, 4, 7]]
    cache = torch.zeros(1, 2, 8, bs, kv_heads, d)
    ctx = PagedAttentionContext(cache, tables, start_pos, num_new)
    for table, start in zip(tables, start_pos):  # earlier tokens already cached
        slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).reshape(-1)[:start]
        cache[0, :, :, :, :, :].view(2, -1, kv_heads, d)[:, slots] = torch.randn(2, start, kv_heads, d)
    t = sum(num_new)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    want = ctx.attend(0, q, k, v, scale=0.3, sliding_window=window)
    max_blocks = max(len(x) for x in tables)
    bt = torch.tensor([x + [0] * (max_blocks - len(x)) for x in tables], dtype=torch.int32)
    lens = torch.tensor([s + n for s, n in zip(start_pos, num_new)], dtype=torch.int32)
    qsl = torch.tensor([0, 6, 11, 12], dtype=torch.int32)
    got = kernels.paged_prefill_attention(q, cache[0, 0], cache[0, 1], bt, lens, qsl, 0.3, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_custom_op_passes_opcheck() -> None:
    case = make_case([3, 2], [0, 5], 4, 2, 8, 4, torch.float32, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, 0.35, 0, 0.0)
    torch.library.opcheck(torch.ops.wllm.paged_prefill_attention.default, args)


def test_out_argument_and_strided_cache_views() -> None:
    """A layer's K/V are views into the engine's [L, 2, blocks, bs, Hkv, D] tensor; out= is filled."""
    case = make_case([5, 3], [2, 0], 4, 2, 8, 4, torch.float32, seed=4)
    big = torch.zeros(3, 2, *case.k_cache.shape)
    big[1, 0], big[1, 1] = case.k_cache, case.v_cache
    out = torch.full_like(case.q, 7.0)
    got = kernels.paged_prefill_attention(case.q, big[1, 0], big[1, 1], case.block_tables, case.seq_lens,
                                          case.query_start_loc, 0.5, out=out)
    assert got is out
    torch.testing.assert_close(out.double(), attention64(case, 0.5), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors() -> None:
    case = make_case([3], [1], 4, 2, 8, 4, torch.float32)
    base = [case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, 1.0]
    with pytest.raises(TypeError, match="block_tables must be int32"):
        kernels.paged_prefill_attention(*base[:3], case.block_tables.long(), *base[4:])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.paged_prefill_attention(case.q[:, :3], *base[1:])
    with pytest.raises(ValueError, match="3 new tokens but seq_lens 2"):
        kernels.paged_prefill_attention(*base[:4], torch.tensor([2], dtype=torch.int32), *base[5:])
    with pytest.raises(ValueError, match=r"query_start_loc \[S \+ 1\]"):
        kernels.paged_prefill_attention(*base[:5], torch.tensor([0, 3, 3], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="must be positive"):
        kernels.paged_prefill_attention(*base, sliding_window=-1)
    with pytest.raises(ValueError, match="seq_lens is on meta"):
        kernels.paged_prefill_attention(*base[:4], case.seq_lens.to("meta"), *base[5:])
    for scale in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            kernels.paged_prefill_attention(*base[:6], scale)


# ------------------------------------------------------------------------------------------
# CUDA kernel vs reference (GPU machine)
# ------------------------------------------------------------------------------------------

# Query lengths 1..300 in one batch with prefix hits of odd sizes (context > query) and an empty row.
MIXED_Q = [1, 37, 300, 5, 0, 128, 17, 64, 1, 129]
MIXED_PREFIX = [0, 90, 0, 211, 4, 33, 0, 64, 500, 7]


def check_cuda(case: Case, scale: float, window: int = 0, softcap: float = 0.0, label: str = "") -> None:
    """Kernel vs reference, sequence by sequence, so a failure names the sequence and worst row."""
    dtype = case.q.dtype
    pad = 3  # rows past query_start_loc[-1] must be left alone
    out = torch.full((case.q.shape[0] + pad, *case.q.shape[1:]), 123.0, dtype=dtype, device="cuda")
    q = torch.cat([case.q, torch.randn(pad, *case.q.shape[1:], device="cuda").to(dtype)])
    kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                    case.query_start_loc, scale, window or None, softcap or None, out=out)
    torch.cuda.synchronize()
    want = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                             case.query_start_loc, scale, window, softcap)
    rtol, atol = TOL[dtype]
    assert torch.all(out[-pad:] == 123.0), f"{label}: rows past query_start_loc[-1] were written"
    row = 0
    for s, (n, ctx) in enumerate(zip(case.q_lens, case.ctx_lens)):
        got, ref = out[row : row + n].float(), want[row : row + n].float()
        if n:
            err = (got - ref).abs().nan_to_num(float("inf"))
            worst = int(err.amax(dim=(1, 2)).argmax())
            where = (f"{label}: sequence {s} (q_len {n}, context {ctx}), worst row {worst} (position "
                     f"{ctx - n + worst}), max err {err.max().item():.3g}")
            assert not torch.isnan(got).any(), f"NaN in output; {where}"
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}\n{m}")
        row += n


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_cuda_head_sizes(dtype: torch.dtype, head_size: int, block_size: int) -> None:
    case = make_case(MIXED_Q, MIXED_PREFIX, 8, 2, head_size, block_size, dtype, "cuda", seed=10, poison=True)
    check_cuda(case, head_size**-0.5, label=f"{dtype} D={head_size} bs={block_size}")


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (8, 2), (14, 2), (7, 1)])
def test_prefill_cuda_gqa(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    case = make_case(MIXED_Q, MIXED_PREFIX, heads, kv_heads, 128, 16, dtype, "cuda", seed=11, poison=True)
    check_cuda(case, 128**-0.5, label=f"{dtype} GQA {heads}/{kv_heads}")


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (64, 0.0), (200, 0.0), (0, 30.0), (100, 50.0), (1, 0.0)])
def test_prefill_cuda_window_softcap(dtype: torch.dtype, head_size: int, window: int, softcap: float) -> None:
    case = make_case(MIXED_Q, MIXED_PREFIX, 8, 4, head_size, 16, dtype, "cuda", seed=12, poison=True)
    # Scaled-up queries so that the soft-cap actually bends the scores.
    case.q.mul_(4.0 if softcap else 1.0)
    check_cuda(case, head_size**-0.5, window, softcap, label=f"{dtype} D={head_size} window={window} cap={softcap}")


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (64, 0.0), (100, 30.0)])
def test_prefill_cuda_many_items_per_cta(window: int, softcap: float) -> None:
    """Several times more (query tile, head) items than a GPU has SMs (45 tiles x 32 heads): the Hopper
    kernel's persistent CTAs each take many, across sequences of every length, both Q buffers and a K/V ring
    that runs on from item to item -- with windows that start items past key 0 and a soft-cap."""
    case = make_case(MIXED_Q * 3, MIXED_PREFIX * 3, 32, 8, 128, 16, torch.bfloat16, "cuda", seed=16, poison=True)
    case.q.mul_(4.0 if softcap else 1.0)
    check_cuda(case, 128**-0.5, window, softcap, label=f"many items window={window} cap={softcap}")


@pytest.mark.cuda
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_prefill_cuda_float32(head_size: int) -> None:
    """fp32 runs the SIMT kernel on every GPU (the SM 7.x path for fp16/bf16 too)."""
    case = make_case(MIXED_Q, MIXED_PREFIX, 6, 2, head_size, 16, torch.float32, "cuda", seed=13, poison=True)
    check_cuda(case, head_size**-0.5, 40, 0.0, label=f"fp32 D={head_size} window=40")
    check_cuda(case, head_size**-0.5, 0, 25.0, label=f"fp32 D={head_size} cap=25")


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_cuda_long_prompt_and_decode_rows(dtype: torch.dtype) -> None:
    """A 2,000-token prompt (many tiles, long causal rows) next to 40 single-token rows."""
    q_lens = [2000] + [1] * 40
    prefix = [0] + [17 * i + 3 for i in range(40)]
    case = make_case(q_lens, prefix, 8, 2, 128, 16, dtype, "cuda", seed=14, poison=True)
    check_cuda(case, 128**-0.5, label=f"{dtype} long prompt")


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
def test_prefill_cuda_strided_q_from_fused_qkv() -> None:
    """q as a slice of a fused qkv projection (token stride > heads * head_size), no copy."""
    torch.manual_seed(15)
    case = make_case([33, 70], [5, 0], 4, 2, 128, 16, torch.bfloat16, "cuda", seed=15)
    t = case.q.shape[0]
    qkv = torch.randn(t, (4 + 2 * 2) * 128, device="cuda", dtype=torch.bfloat16)
    qkv[:, : 4 * 128] = case.q.reshape(t, -1)
    q = qkv[:, : 4 * 128].view(t, 4, 128)
    got = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                          case.query_start_loc, 0.1)
    want = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                             case.query_start_loc, 0.1)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
def test_prefill_cuda_inside_graph_and_compile() -> None:
    """Replays of a captured call see new inputs; the custom op traces under torch.compile. Head
    size 128 needs more than 48 KB of shared memory, so the attribute call happens under capture."""
    case = make_case([40, 9], [3, 60], 8, 2, 128, 16, torch.float16, "cuda", seed=16)
    args = (case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, 0.125)
    q = case.q.clone()
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.paged_prefill_attention(q, *args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_prefill_attention(q, *args, out=out)
    for trial in range(2):
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, reference.paged_prefill_attention(q, *args), rtol=5e-3, atol=5e-3,
                                   msg=f"replay {trial}")
    compiled = torch.compile(lambda x: kernels.paged_prefill_attention(x, *args) * 2, fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q), reference.paged_prefill_attention(q, *args) * 2, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_prefill_cuda_rejects_unsupported_head_size() -> None:
    case = make_case([4], [0], 2, 1, 48, 16, torch.float16, "cuda")
    with pytest.raises(ValueError, match="head size 48 has no CUDA kernel"):
        kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                        case.query_start_loc, 1.0 / math.sqrt(48))


@pytest.mark.usefixtures("prefill_kernel")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_cuda_leading_rows_of_other_sequences(dtype: torch.dtype) -> None:
    """The engine's mixed steps hand the prefill kernel q with the decode rows in front:
    query_start_loc[0] > 0. Those rows must stay untouched; the others match the reference."""
    case = make_case(MIXED_Q, MIXED_PREFIX, 8, 2, 128, 16, dtype, "cuda", seed=15, poison=True)
    n = 3
    lead = int(case.query_start_loc[n])
    out = torch.full(case.q.shape, 123.0, dtype=dtype, device="cuda")
    args = (case.block_tables[n:], case.seq_lens[n:], case.query_start_loc[n:])
    kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache, *args, 128**-0.5, out=out)
    torch.cuda.synchronize()
    want = reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, *args, 128**-0.5)
    assert lead > 0 and torch.all(out[:lead] == 123.0), "rows of the leading sequences were written"
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out[lead:].float(), want[lead:].float(), rtol=rtol, atol=atol)
