"""The Hopper GEMM (wllm.kernels.gemm_sm90) against cuBLAS, SM 9.0 GPUs.

Per M (tokens of a step) and model shape: the gated MLP's gate_up projection with its activation --
cuBLAS + act_and_mul (the path outside linear.SM90_GEMM_ROWS) against one gemm_sm90 call with the gated
epilogue -- and each projection of a decoder layer as a plain GEMM, ours against F.linear. Ours runs with
each schedule (whole tiles, stream-K) and auto's choice. Weights rotate over enough copies that none is
served from L2; each time comes from a CUDA graph of one call per copy.

    python benchmarks/kernels_gemm_sm90.py [--shape llama-3.1-8b] [--m 239,512,1024,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from wllm.bench.timing import bench_dtype, graph_us, kernel_bench_args
from wllm.kernels import act_and_mul, gemm_sm90
from wllm.kernels.gemm_sm90 import supported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_shapes import L2_BYTES, projections  # noqa: E402


def _cublas(x: torch.Tensor, w: torch.Tensor, act: str | None) -> torch.Tensor:
    """The engine's path without gemm_sm90: cuBLAS, then the activation kernel when gated."""
    y = F.linear(x, w)
    return y if act is None else act_and_mul(y, act)


def _calls(fn, x: torch.Tensor, weights: list[torch.Tensor], act: str | None, **kw):
    """One call of fn per weight copy (for graph_us)."""
    return lambda: [fn(x, w, act, **kw) for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--m", default="239,512,1024,4096,8192")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = kernel_bench_args(parser)
    if not supported(0):
        raise SystemExit(f"gemm_sm90 needs an SM 9.0 GPU (this one is {torch.cuda.get_device_capability()})")
    dtype = bench_dtype(args.dtype)
    rows = []
    projs = {k: v for k, v in projections(args.shape).items() if k != "lm_head"}
    print(f"{args.shape}, {args.dtype}: us per call (CUDA graphs), x = cuBLAS path / ours (auto)")
    print(f"{'M':>6} {'what':>16} {'cuBLAS':>9} {'tiles':>9} {'stream-K':>9} {'auto':>9} {'x':>6} "
          f"{'auto TFLOP/s':>13}")
    for name, (n, k) in projs.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            cases = [(name, None, n)] + ([("gate_up+act", "silu", n // 2)] if name == "gate_up" else [])
            for label, act, out_n in cases:
                theirs = graph_us(_calls(_cublas, x, weights, act), len(weights))
                sched = {s: graph_us(_calls(gemm_sm90, x, weights, act, schedule=s), len(weights))
                         for s in ("tiles", "stream_k", "auto")}
                ours = sched["auto"]
                tflops = 2 * m * n * k / ours / 1e6
                print(f"{m:>6} {label:>16} {theirs:9.1f} {sched['tiles']:9.1f} {sched['stream_k']:9.1f} "
                      f"{ours:9.1f} {theirs / ours:6.2f} {tflops:13.0f}")
                rows.append({"m": m, "what": label, "out_n": out_n, "cublas_us": round(theirs, 2),
                             **{f"{s}_us": round(v, 2) for s, v in sched.items()}})
    if args.json:
        print(json.dumps({"shape": args.shape, "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
