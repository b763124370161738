"""CUDA-event timing shared by the kernel micro-benchmarks."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median time of fn() in milliseconds, measured with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(fn: Callable[[], object], calls: int, warmup: int = 3, iters: int = 20) -> float:
    """Microseconds per call when fn (which makes `calls` calls) is captured in a CUDA graph and replayed:
    GPU time only, as the engine's graphs see it (timed call by call, a small kernel or library call would
    measure its host work)."""
    from wllm.engine.cuda_graphs import capture_graph

    graph, _ = capture_graph(fn)
    us = cuda_time_ms(graph.replay, warmup, iters) * 1e3 / calls
    del graph
    return us


def assert_cases_agree(cases: dict[str, Callable[[], object]], out: torch.Tensor, tol: float) -> None:
    """Run each case (each writes `out`, zeroed first) and check it against the first case's result:
    max |difference| / max |reference| below `tol`. For probes that time several ways of one computation."""
    ref = None
    for name, fn in cases.items():
        out.zero_()
        fn()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
            continue
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < tol, f"{name}: relative error {err}"


def kernel_bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add --json, parse, and make sure the GPU and the kernel library are there (exit with a clear
    message otherwise); seeds torch. Shared by the benchmarks/kernels_*.py scripts."""
    from wllm import kernels

    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not kernels.available():
        raise SystemExit("needs a CUDA GPU and the wLLM kernel library")
    torch.manual_seed(0)
    return args


def bench_dtype(name: str) -> torch.dtype:
    """"bf16" or "fp16" (the kernel benchmarks' --dtype) as a torch dtype."""
    return torch.bfloat16 if name == "bf16" else torch.float16
