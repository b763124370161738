"""Paged decode attention bandwidth: GB/s of the KV it must read, as a fraction of the H200's copy rate.

Default: batch 64 x context 4,096 with Llama-3.1-8B heads (32 query, 8 KV, head size 128) in bf16,
block size 16, blocks scattered through the cache as in a long-running server. Bytes counted: every
K and V row of every sequence once, plus q and out. Rows: the automatic split, then forced split
counts, then the same call replayed from a CUDA graph (how the engine runs it), then the offline
throughput shape (240 sequences of 512-640 tokens, same heads, graph captured for max_seq_len 4,096;
its own bytes). The latency table times batch-1 decode attention as the engine runs it: a CUDA graph
captured for max_seq_len 4,096 holding one call per layer, for the Qwen2.5-0.5B and Llama-3.1-8B head
layouts at contexts 128, 512 and 1,024, in microseconds per call, with L2 hot (the same few KB every
layer) and cold (a 256 MB write between calls evicts the KV, as a real step's weight stream does; its own
time is subtracted), and hot once more on tensor cores ("MMA hot"; by default batch 1 runs the FMA
kernel). The large-batch rows run on tensor cores (the default there) and once on the FMA kernel. A
last table times the fused SiLU-and-mul and the sampler at the same batch for context.

    python benchmarks/kernels_decode.py [--batch 64] [--context 4096] [--heads 32] [--kv-heads 8]
        [--head-size 128] [--block-size 16] [--dtype bf16|fp16] [--vocab 128256] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import bench_dtype, cuda_time_ms, kernel_bench_args
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import ops, reference

COPY_FLOOR_GBS = H200.bandwidth / 1e9  # measured ceiling (wllm.bench.floors)


def time_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    return cuda_time_ms(fn, warmup, iters)


def graphed(fn):
    """fn captured in a CUDA graph; returns a callable that replays it."""
    return capture_graph(fn)[0].replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary for the sampler row")
    parser.add_argument("--intermediate", type=int, default=14336, help="MLP width for the SiLU-and-mul row")
    parser.add_argument("--layers", type=int, default=24, help="calls per graph in the latency table")
    args = kernel_bench_args(parser)

    dtype = bench_dtype(args.dtype)
    b, ctx, hq, hkv, d, bs = args.batch, args.context, args.heads, args.kv_heads, args.head_size, args.block_size
    blocks_per_seq = (ctx + bs - 1) // bs
    num_blocks = b * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda").view(b, blocks_per_seq).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = d**-0.5
    itemsize = q.element_size()
    nbytes = 2 * b * ctx * hkv * d * itemsize + 2 * q.numel() * itemsize
    max_len = blocks_per_seq * bs

    def run(splits: int, workspace: torch.Tensor | None):
        return lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_seq_len=max_len,
                                                      num_splits=splits, out=out, workspace=workspace)

    def workspace_for(splits: int) -> torch.Tensor:
        size = ops.decode_workspace_size(b, hq, hkv, d, max_len, splits)
        return torch.zeros(size // 4 + 1, device="cuda")  # zeroed: the split-merge tickets live there

    want = reference.paged_decode_attention(q[:4], k_cache, v_cache, tables[:4], lens[:4], scale)
    run(0, workspace_for(0))()
    max_err = (out[:4].float() - want.float()).abs().max().item()

    rows = []
    for label, splits in [("auto", 0), ("1 (no split)", 1), ("2", 2), ("4", 4), ("8", 8)]:
        ms = time_ms(run(splits, workspace_for(splits)))
        rows.append((f"splits {label}", ms))
    ms = time_ms(graphed(run(0, workspace_for(0))))
    rows.append(("splits auto, CUDA graph", ms))
    with decode_kernel(False):
        rows.append(("splits auto, graph, FMA kernel", time_ms(graphed(run(0, workspace_for(0))))))
    rows = [(label, ms, nbytes) for label, ms in rows]
    rows.append(medium_row(dtype, hq, hkv, d, bs))
    with decode_kernel(False):
        label, ms, medium_bytes = medium_row(dtype, hq, hkv, d, bs)
        rows.append((label + ", FMA kernel", ms, medium_bytes))

    print(f"paged decode attention: batch {b} x context {ctx}, {hq} q / {hkv} kv heads, head size {d}, "
          f"{args.dtype}, block size {bs} (scattered); {nbytes / 1e9:.3f} GB of KV + q/out per call; "
          f"max |err| vs reference {max_err:.2e}")
    print(f"{'variant':<30}{'ms':>10}{'GB/s':>10}{'of 4,232 GB/s':>16}")
    results = []
    for label, ms, row_bytes in rows:
        gbs = row_bytes / ms / 1e6
        results.append({"variant": label, "ms": ms, "gbs": gbs, "fraction": gbs / COPY_FLOOR_GBS})
        print(f"{label:<30}{ms:>10.4f}{gbs:>10.0f}{gbs / COPY_FLOOR_GBS:>15.1%}")

    latency = latency_table(dtype, args.layers)

    # Context: the other per-step decode kernels at the same batch.
    x = torch.randn(b, 2 * args.intermediate, device="cuda", dtype=dtype)
    ms_act = time_ms(lambda: kernels.silu_and_mul(x))
    act_bytes = x.numel() * itemsize * 1.5
    logits = torch.randn(b, args.vocab, device="cuda")
    rows_greedy = kernels.pack_sampling_rows([_Row(0.0, 1.0)] * b, "cuda")
    rows_top_p = kernels.pack_sampling_rows([_Row(0.8, 0.95)] * b, "cuda")
    ms_greedy = time_ms(lambda: kernels.sample(logits, **rows_greedy))
    ms_top_p = time_ms(lambda: kernels.sample(logits, **rows_top_p))
    print(f"\nsilu_and_mul [{b}, {2 * args.intermediate}]: {ms_act * 1e3:.1f} us "
          f"({act_bytes / ms_act / 1e6:.0f} GB/s)")
    print(f"sample [{b}, {args.vocab}] greedy: {ms_greedy * 1e3:.1f} us; temperature 0.8 + top_p 0.95: "
          f"{ms_top_p * 1e3:.1f} us")
    if args.json:
        print(json.dumps({"batch": b, "context": ctx, "heads": hq, "kv_heads": hkv, "head_size": d,
                          "dtype": args.dtype, "bytes": nbytes, "max_err": max_err, "decode": results,
                          "latency": latency,
                          "silu_and_mul_us": ms_act * 1e3, "sample_greedy_us": ms_greedy * 1e3,
                          "sample_top_p_us": ms_top_p * 1e3}))
    return 0


MEDIUM_BATCH, MEDIUM_CONTEXTS, MEDIUM_MAX_LEN = 240, (512, 640), 4096


@contextlib.contextmanager
def decode_kernel(tensor_cores: bool):
    """Decode attention on tensor cores for every batch (True), or on the FMA kernel (False: the one sm_7x,
    fp32 and head size 256 use), instead of the default (tensor cores for large batches only)."""
    previous = kernels.set_decode_mma(tensor_cores, small_batch=True)
    try:
        yield
    finally:
        kernels.set_decode_mma(previous)


def medium_row(dtype: torch.dtype, hq: int, hkv: int, d: int, bs: int) -> tuple[str, float, int]:
    """The offline-throughput shape: 240 sequences of 512-640 tokens (uniform), one CUDA graph replay with
    the engine's max_seq_len; returns (label, ms, bytes of KV + q/out)."""
    gen = torch.Generator().manual_seed(1)
    lo, hi = MEDIUM_CONTEXTS
    lens_list = torch.randint(lo, hi + 1, (MEDIUM_BATCH,), generator=gen).tolist()
    blocks = [(n + bs - 1) // bs for n in lens_list]
    max_blocks = MEDIUM_MAX_LEN // bs
    order = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(MEDIUM_BATCH, max_blocks, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[start : start + n].to(torch.int32)
        start += n
    k_cache = torch.randn(sum(blocks), bs, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(MEDIUM_BATCH, hq, d, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    tables, lens = tables.cuda(), torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    size = ops.decode_workspace_size(MEDIUM_BATCH, hq, hkv, d, MEDIUM_MAX_LEN)
    workspace = torch.zeros(size // 4 + 1, device="cuda") if size else None

    def call() -> None:
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5, max_seq_len=MEDIUM_MAX_LEN,
                                       out=out, workspace=workspace)

    ms = time_ms(graphed(call))
    nbytes = 2 * sum(lens_list) * hkv * d * q.element_size() + 2 * q.numel() * q.element_size()
    return f"batch {MEDIUM_BATCH} x {lo}-{hi}, graph", ms, nbytes


LATENCY_LAYOUTS = [("qwen2.5-0.5b", 14, 2, 64), ("llama-3.1-8b", 32, 8, 128)]
LATENCY_TARGET_US = 4.0  # per layer, the target for batch-1 decode attention


def latency_table(dtype: torch.dtype, layers: int, contexts: tuple[int, ...] = (128, 512, 1024),
                  max_len: int = 4096, block_size: int = 16) -> list[dict]:
    """Batch-1 decode attention per call (us) replayed from one graph of `layers` calls, each layer with
    its own scattered blocks; hot and cold L2 (see the module docstring)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    print(f"\nlatency: batch 1, graph captured for max_seq_len {max_len}, {layers} calls per graph "
          f"(one per layer), block size {block_size}; target <= {LATENCY_TARGET_US:.0f} us per layer")
    print(f"{'model heads':<28}{'context':>8}{'grid splits':>12}{'hot us':>9}{'cold us':>9}{'MMA hot':>9}"
          f"{'floor us':>10}{'max err':>10}")
    for name, hq, hkv, d in LATENCY_LAYOUTS:
        for ctx in contexts:
            row = _latency_row(dtype, layers, hq, hkv, d, ctx, max_len, block_size, flush)
            with decode_kernel(True):
                row["mma_hot_us"] = _latency_row(dtype, layers, hq, hkv, d, ctx, max_len, block_size, flush)["hot_us"]
            label = f"{name} {hq}/{hkv} D={d}"
            print(f"{label:<28}{ctx:>8}{row['grid_splits']:>12}{row['hot_us']:>9.2f}{row['cold_us']:>9.2f}"
                  f"{row['mma_hot_us']:>9.2f}{row['floor_us']:>10.3f}{row['max_err']:>10.1e}")
            results.append({"model": name, "context": ctx, **row})
    return results


def _latency_row(dtype: torch.dtype, layers: int, hq: int, hkv: int, d: int, ctx: int, max_len: int,
                 block_size: int, flush: torch.Tensor) -> dict:
    blocks = (ctx + block_size - 1) // block_size
    k_cache = torch.randn(layers * blocks, block_size, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(layers, max_len // block_size, dtype=torch.int32, device="cuda")
    tables[:, :blocks] = torch.randperm(layers * blocks, device="cuda").view(layers, blocks).to(torch.int32)
    q = torch.randn(1, hq, d, device="cuda", dtype=dtype)
    lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    size = ops.decode_workspace_size(1, hq, hkv, d, max_len)
    workspace = torch.zeros(size // 4 + 1, device="cuda")
    scale = d**-0.5

    def call(layer: int) -> None:
        kernels.paged_decode_attention(q, k_cache, v_cache, tables[layer : layer + 1], lens, scale,
                                       max_seq_len=max_len, out=out, workspace=workspace)

    def hot() -> None:
        for layer in range(layers):
            call(layer)

    def cold() -> None:
        for layer in range(layers):
            flush.zero_()
            call(layer)

    def flush_only() -> None:
        for _ in range(layers):
            flush.zero_()

    call(0)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables[:1], lens, scale)
    err = (out.float() - want.float()).abs().max().item()
    hot_us = time_ms(graphed(hot)) * 1e3 / layers
    cold_us = (time_ms(graphed(cold)) - time_ms(graphed(flush_only))) * 1e3 / layers
    # Workspace = 16 KB of tickets + per split (D + 2) fp32 per query head (batch 1).
    splits = max(1, (size - 16384) // (4 * hq * (d + 2))) if size else 1
    floor_us = 2 * ctx * hkv * d * q.element_size() / H200.bandwidth * 1e6
    return {"grid_splits": splits, "hot_us": hot_us, "cold_us": cold_us, "floor_us": floor_us, "max_err": err}


class _Row:
    """A minimal sampling row (what pack_sampling_rows reads) for the sampler timing."""

    def __init__(self, temperature: float, top_p: float) -> None:
        from wllm.sampling_params import SamplingParams

        self.params = SamplingParams(temperature=temperature, top_p=top_p)
        self.seed, self.index = 0, 0
        self.prompt_token_ids, self.output_token_ids, self.eos_token_ids = [], [], []


if __name__ == "__main__":
    raise SystemExit(main())
