"""cuBLAS GEMM efficiency at the batch sizes the engine runs: the linear layers of a model shape,
M tokens at a time (M = batch for decode steps, step tokens for prefill), against the floor
max(FLOPs / peak, bytes / bandwidth) from the H200's measured ceilings (wllm.bench.floors).

The offline throughput run spends most of its time in these GEMMs: ~16 steps of ~8k tokens and
~128 decode steps of ~240 rows (8B). This prints, per M, the time of one decoder layer's four
projections and the lm_head, and how far each is from its floor. Weights rotate over enough
copies that none is served from L2; each time comes from a CUDA graph of one call per copy.
`--blas cublaslt` uses torch's cuBLASLt path, `--blas both` times each M under both libraries in one
process.

    python benchmarks/gemm_shapes.py [--shape llama-3.1-8b] [--m 64,128,256,...] [--blas cublas|cublaslt|both]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from wllm.bench.floors import H200
from wllm.bench.shapes import resolve_shape
from wllm.bench.timing import graph_us

L2_BYTES = 64 << 20  # more than the H200's 50 MB L2


def projections(shape_name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer, plus the lm_head."""
    cfg = resolve_shape(shape_name).hf_config
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (cfg["vocab_size"], h)}


def linear_us(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    """Microseconds per x @ W.T, from a CUDA graph that runs it once per weight copy: GPU time only, as the
    engine's graphs see it (timed call by call, small M would measure cuBLAS's ~10-25 us of host work)."""
    return graph_us(lambda: [F.linear(x, w) for w in ws], len(ws))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--m", default="16,64,128,192,240,256,320,384,512,1024,2048,4096,8192")
    parser.add_argument("--blas", choices=["cublas", "cublaslt", "both"], default=None,
                        help="torch's BLAS library (default: torch's own choice); both: each M under each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    libraries = ["cublas", "cublaslt"] if args.blas == "both" else [args.blas]
    dtype = torch.bfloat16
    projs = projections(args.shape)
    ms = [int(x) for x in args.m.split(",")]
    weights = {}
    for name, (n, k) in projs.items():
        copies = max(1, -(-2 * L2_BYTES // (n * k * 2)))
        weights[name] = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    results = []
    print(f"{args.shape}, bf16; floor = max(FLOPs / {H200.flops / 1e12:.0f} TFLOP/s, "
          f"bytes / {H200.bandwidth / 1e9:,.0f} GB/s)")
    head = " ".join(f"{n + ' us':>12} {'%':>4}" for n in projs)
    print(f"{'M':>6} {'blas':>9} {head} {'layer us':>9} {'%':>4}")
    for m, lib in ((m, lib) for m in ms for lib in libraries):
        if lib:
            torch.backends.cuda.preferred_blas_library(lib)
        in_use = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
        row = {"m": m, "blas": in_use}
        layer_t = layer_floor = 0.0
        cells = []
        for name, (n, k) in projs.items():
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            t = linear_us(x, weights[name])
            flops = 2.0 * m * n * k
            nbytes = 2.0 * (n * k + m * k + m * n)
            floor = max(flops / H200.flops, nbytes / H200.bandwidth) * 1e6
            row[name] = {"us": t, "floor_us": floor, "tflops": flops / t / 1e6}
            cells.append(f"{t:12.1f} {100 * floor / t:4.0f}")
            if name != "lm_head":
                layer_t += t
                layer_floor += floor
        row["layer_us"], row["layer_floor_us"] = layer_t, layer_floor
        results.append(row)
        print(f"{m:6d} {in_use:>9} " + " ".join(cells) + f" {layer_t:9.1f} {100 * layer_floor / layer_t:4.0f}")
    if args.json:
        print(json.dumps({"shape": args.shape, "rows": results}))


if __name__ == "__main__":
    main()
