"""Fused rotary + KV-cache write (`rotary_and_cache`) against the two kernels it replaces.

Per attention layer the engine rotated q and k (`rotary_embedding`) and then wrote k and v into the
paged cache (`reshape_and_cache`); `rotary_and_cache` does both in one launch. Both variants run
from a CUDA graph of `--layers` back-to-back calls (as in a decode step's graph), so a row's
"us/call" is the device time one layer pays. Shapes: Qwen2.5-0.5B (14 q / 2 kv heads, head size
64) and Llama-3.1-8B (32 / 8, 128), bf16, block size 16, q/k/v as views of one fused qkv output.
The floor is the bytes each call must move (q read + written, k and v read, k and v written to the
cache, the cos/sin rows) at the H200's copy bandwidth; at these sizes launch latency dominates.

    python benchmarks/kernels_rope_cache.py [--tokens 1 64] [--layers 32] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import cuda_time_ms, kernel_bench_args
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import reference

SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.1-8b": (32, 8, 128)}


def case(name: str, tokens: int, layers: int) -> dict:
    """Time both variants for one shape and token count; returns one result row."""
    heads, kv_heads, d = SHAPES[name]
    dtype, block_size = torch.bfloat16, 16
    num_blocks = tokens // block_size + 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device="cuda", dtype=dtype)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d, device="cuda", dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    table = kernels.rotary_cos_sin_cache(8192, d, 500000.0).cuda()

    # Correctness of the timed call against the reference before timing it.
    q_ref, cache_ref = q.clone(), cache.clone()
    reference.rotary_and_cache(positions, q_ref, k, v, cache_ref[0], cache_ref[1], slots, table, True)
    q_run, cache_run = q.clone(), cache.clone()
    kernels.rotary_and_cache(positions, q_run, k, v, cache_run[0], cache_run[1], slots, table, True)
    max_err = max((q_run.float() - q_ref.float()).abs().max().item(),
                  (cache_run.float() - cache_ref.float()).abs().max().item())

    def fused() -> None:
        for _ in range(layers):
            kernels.rotary_and_cache(positions, q, k, v, cache[0], cache[1], slots, table, True)

    def unfused() -> None:
        for _ in range(layers):
            kernels.rotary_embedding(positions, q, k, d, table, True)
            kernels.reshape_and_cache(k, v, cache[0], cache[1], slots)

    us = {}
    for label, fn in (("fused", fused), ("two kernels", unfused)):
        graph = capture_graph(fn)[0]
        us[label] = cuda_time_ms(graph.replay, warmup=5, iters=50) * 1e3 / layers
    nbytes = (2 * heads + 4 * kv_heads) * d * tokens * qkv.element_size() + tokens * d * 4 + tokens * 16
    return {"shape": name, "tokens": tokens, "fused_us": us["fused"], "two_kernels_us": us["two kernels"],
            "bytes": nbytes, "floor_us": nbytes / H200.bandwidth * 1e6, "max_err": max_err}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=32, help="calls per captured graph (one per layer)")
    args = kernel_bench_args(parser)
    rows = [case(name, t, args.layers) for name in SHAPES for t in args.tokens]
    print(f"rotary + KV-cache write per layer, bf16, CUDA graph of {args.layers} calls; floor = bytes at "
          f"{H200.bandwidth / 1e9:,.0f} GB/s")
    print(f"{'shape':<14}{'T':>5}{'fused us':>10}{'2 kernels us':>14}{'saved us':>10}{'floor us':>10}"
          f"{'fused/floor':>13}{'max err':>10}")
    for r in rows:
        print(f"{r['shape']:<14}{r['tokens']:>5}{r['fused_us']:>10.2f}{r['two_kernels_us']:>14.2f}"
              f"{r['two_kernels_us'] - r['fused_us']:>10.2f}{r['floor_us']:>10.3f}"
              f"{r['fused_us'] / r['floor_us']:>12.0f}x{r['max_err']:>10.1e}")
    if args.json:
        print(json.dumps({"layers": args.layers, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
