"""The Hopper GEMM (wllm.kernels.gemm_sm90) against cuBLAS, SM 9.0 GPUs.

Per M (tokens of a step) and model shape: the gated MLP's gate_up projection with its activation --
cuBLAS + act_and_mul (the path below SM90_GATED_GEMM_MIN_ROWS) against one gemm_sm90 call with the gated
epilogue -- and each projection of a decoder layer as a plain GEMM, ours against F.linear. Weights rotate
over enough copies that none is served from L2; each time comes from a CUDA graph of one call per copy.

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


def _calls(fn, x: torch.Tensor, weights: list[torch.Tensor], act: str | None):
    """One call of fn per weight copy (for graph_us)."""
    return lambda: [fn(x, w, act) for w in weights]


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
    print(f"{args.shape}, {args.dtype}: us per call (CUDA graphs), x = cuBLAS path / ours")
    print(f"{'M':>6} {'what':>16} {'cuBLAS':>9} {'ours':>9} {'x':>6} {'ours TFLOP/s':>13}")
    for name, (n, k) in projs.items():
        copies = max(1, -(-L2_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            cases = [(name, None, n)] + ([("gate_up+act", "silu", n // 2)] if name == "gate_up" else [])
            for label, act, out_n in cases:
                theirs = graph_us(_calls(_cublas, x, weights, act), len(weights))
                ours = graph_us(_calls(gemm_sm90, x, weights, act), len(weights))
                tflops = 2 * m * n * k / ours / 1e6
                print(f"{m:>6} {label:>16} {theirs:9.1f} {ours:9.1f} {theirs / ours:6.2f} {tflops:13.0f}")
                rows.append({"m": m, "what": label, "out_n": out_n, "cublas_us": round(theirs, 2),
                             "ours_us": round(ours, 2)})
    if args.json:
        print(json.dumps({"shape": args.shape, "dtype": args.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
