"""Decode attention's TMA modes side by side, in one process (SM 9.0): the persistent kernel (the default
for calls without splits), one CTA per (sequence, KV head), and per-row bulk copies. Each case is a CUDA
graph of `--calls` calls (one per layer, each on its own KV cache, as a decode step runs them), captured
once per mode; rounds alternate the modes and the median is reported, as GB/s of the K/V rows read and
as a fraction of the H200's copy bandwidth.

Cases: the issue's micro-benchmark (64 x 4,096, Llama-3.1-8B heads), the 8B offline batch's decode steps
(256 sequences of 512-640 tokens), and the 0.5B batch's (Qwen2.5-0.5B heads, head size 64).

    python benchmarks/kernels_decode_tma.py [--rounds 5] [--calls 8] [--block-size 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm import kernels  # noqa: E402
from wllm.bench.floors import H200  # noqa: E402
from wllm.bench.timing import graph_us  # noqa: E402

MODES = ("persistent", "per-cta", "off")
# name, sequences, context lengths (cycled), query heads, KV heads, head size
CASES = [
    ("64 x 4096, Llama heads", 64, [4096], 32, 8, 128),
    ("256 x 512-640, Llama heads", 256, list(range(512, 641, 7)), 32, 8, 128),
    ("256 x 512-640, Qwen 0.5B heads", 256, list(range(512, 641, 7)), 14, 2, 64),
]


def build_case(seqs: int, lens: list[int], heads: int, kv_heads: int, head_size: int, block_size: int, calls: int,
               gen: torch.Generator):
    """q, per-call caches with scattered block tables, lengths, and the K/V bytes one call reads."""
    n = torch.tensor([lens[i % len(lens)] for i in range(seqs)], dtype=torch.int32)
    blocks = (-(-n // block_size)).tolist()
    width = max(blocks)
    total = sum(blocks)
    tables = torch.zeros(seqs, width, dtype=torch.int32)
    order = torch.randperm(total, generator=gen)
    at = 0
    for s, b in enumerate(blocks):
        tables[s, :b] = order[at:at + b].int()
        at += b
    caches = [torch.randn(2, total, block_size, kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
              for _ in range(calls)]
    q = torch.randn(seqs, heads, head_size, device="cuda", dtype=torch.bfloat16)
    kv_bytes = int(n.sum()) * kv_heads * head_size * 2 * 2
    return q, caches, tables.cuda(), n.cuda(), kv_bytes, width * block_size


def make_step(q, caches, tables, n, scale: float, max_len: int):
    """One decode step's attention calls, one per layer's cache."""

    def step():
        return [kernels.paged_decode_attention(q, c[0], c[1], tables, n, scale, max_seq_len=max_len) for c in caches]

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8, help="calls per graph, each on its own cache")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    gen = torch.Generator().manual_seed(0)
    floor = H200.bandwidth / 1e9
    rows = []
    for name, seqs, lens, heads, kv_heads, head_size in CASES:
        q, caches, tables, n, kv_bytes, max_len = build_case(seqs, lens, heads, kv_heads, head_size, args.block_size,
                                                             args.calls, gen)
        outs = {}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        step = make_step(q, caches, tables, n, head_size**-0.5, max_len)
        for mode in MODES:
            previous = kernels.set_decode_tma(mode)
            outs[mode] = step()[0].float()
            kernels.set_decode_tma(previous)
        for mode in MODES[1:]:
            torch.testing.assert_close(outs[mode], outs[MODES[0]], rtol=2e-2, atol=2e-2)
        for _ in range(args.rounds):
            for mode in MODES:
                previous = kernels.set_decode_tma(mode)
                times[mode].append(graph_us(step, args.calls))
                kernels.set_decode_tma(previous)
        for mode in MODES:
            us = statistics.median(times[mode])
            gbs = kv_bytes / (us * 1e-6) / 1e9
            rows.append((name, mode, us, gbs, gbs / floor))
    print(f"| case | TMA mode | us per call | GB/s | of copy ({floor:,.0f} GB/s) |")
    print("|---|---|---:|---:|---:|")
    for name, mode, us, gbs, frac in rows:
        print(f"| {name} | {mode} | {us:.1f} | {gbs:,.0f} | {frac:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
