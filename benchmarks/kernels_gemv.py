"""Skinny GEMM (wllm.kernels.gemv) vs cuBLAS (F.linear) on every decode matrix of Qwen2.5-0.5B and Llama-3.1-8B.

For each matrix and M rows of x (M = 1, 2, 4, 8 by default): microseconds per call of our kernel and of
F.linear, the weight bandwidth ours reaches (bytes of W and bias read once / time) and its fraction of the
H200's 4,232 GB/s copy rate. Every call is replayed from a CUDA graph (as the engine runs decode), over
enough copies of the weight (>= 256 MB in all) that each call reads it from HBM, not from the 50-60 MB L2,
as in a real decode step. A second table times the MLP's down projection with the activation fused
(gemv with silu) against act_and_mul + F.linear (the unfused path) and act_and_mul + gemv. A third times
each kernel variant of gemv (split-K; row-group with lanes per row chosen from K, or forced to 32/16/8;
register-prefetch) so that the automatic choice and the dispatch limits in linear.py / mlp.py can be set
from one run. A fourth times each variant for 1-2 rows right behind the kernel that writes its x
(fused_add_rms_norm, then the GEMV, PDL on, as in a decode layer; the down projection with SiLU fused and
plain, the gate_up projection plain and writing SiLU(gate) * up; the lm_head too):
the GEMV's marginal cost there = that chain minus the norms alone, which is what a variant that loads W
before its PDL wait (reg_prefetch) can hide and a standalone timing cannot show.

    python benchmarks/kernels_gemv.py [--rows 1 2 4 8] [--dtype bf16|fp16] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import bench_dtype, graph_us, kernel_bench_args
from wllm.kernels import reference
from wllm.kernels.gemv import VARIANTS, gemv_variant

COPY_FLOOR_GBS = H200.bandwidth / 1e9  # measured ceiling (wllm.bench.floors)
FLUSH_BYTES = 256 << 20  # weights cycled per timing: several times any L2

# (model, matrix, out_features, in_features, bias, layers): the linear layers of one decoder layer.
MATRICES = [
    ("qwen2.5-0.5b", "qkv", 1152, 896, True, 24),
    ("qwen2.5-0.5b", "o", 896, 896, False, 24),
    ("qwen2.5-0.5b", "gate_up", 9728, 896, False, 24),
    ("qwen2.5-0.5b", "down", 896, 4864, False, 24),
    ("llama-3.1-8b", "qkv", 6144, 4096, False, 32),
    ("llama-3.1-8b", "o", 4096, 4096, False, 32),
    ("llama-3.1-8b", "gate_up", 28672, 4096, False, 32),
    ("llama-3.1-8b", "down", 4096, 14336, False, 32),
    ("qwen2.5-0.5b", "lm_head", 151936, 896, False, 1),
    ("llama-3.1-8b", "lm_head", 128256, 4096, False, 1),
]


def time_us(variant: str, x: torch.Tensor, ws: list[torch.Tensor], b: torch.Tensor | None) -> float:
    """Microseconds per call of one variant, from a CUDA graph that calls it once per weight copy."""
    def call(w: torch.Tensor) -> torch.Tensor:
        if variant == "gemv":
            return kernels.gemv(x, w, b)
        if variant == "cublas":
            return F.linear(x, w, b)
        if variant == "fused":
            return kernels.gemv(x, w, b, "silu")
        if variant in VARIANTS:
            return gemv_variant(x, w, b, None, variant)
        if variant == "act+cublas":
            return F.linear(kernels.silu_and_mul(x), w, b)
        return kernels.gemv(kernels.silu_and_mul(x), w, b)  # act+gemv

    return graph_us(lambda: [call(w) for w in ws], len(ws))


def chain_us(variant: str, x: torch.Tensor, ws: list[torch.Tensor], b: torch.Tensor | None,
             activation: str | None, output_activation: str | None = None) -> float:
    """Microseconds per (fused_add_rms_norm writing x in place, GEMV of x) pair from a CUDA graph with PDL
    on, one pair per weight copy; variant "norm" times the norms alone."""
    residual = torch.zeros_like(x)
    norm_w = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)

    def call(w: torch.Tensor) -> torch.Tensor:
        kernels.fused_add_rms_norm(x, residual, norm_w, 1e-6)
        return x if variant == "norm" else gemv_variant(x, w, b, activation, variant, output_activation)

    previous = kernels.set_pdl(True)  # captured with PDL on; the replay keeps it
    try:
        return graph_us(lambda: [call(w) for w in ws], len(ws))
    finally:
        kernels.set_pdl(previous)


def weights(n: int, k: int, bias: bool, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
    """Enough copies of a random [n, k] weight to cycle through FLUSH_BYTES; returns (copies, bias, bytes per call)."""
    one = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    nbytes = one.numel() * one.element_size()
    copies = [one] + [one.clone() for _ in range(max(1, math.ceil(FLUSH_BYTES / nbytes)) - 1)]
    b = torch.randn(n, device="cuda").to(dtype) if bias else None
    return copies, b, nbytes + (b.numel() * b.element_size() if b is not None else 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="rows of x (decode batch)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--quick", action="store_true", help="only the first table (auto kernel vs cuBLAS)")
    args = kernel_bench_args(parser)
    dtype = bench_dtype(args.dtype)

    print(f"skinny GEMM vs cuBLAS (F.linear), {args.dtype}, CUDA graphs, weights cycled through "
          f"{FLUSH_BYTES >> 20} MB (read from HBM); floor = weight bytes / {COPY_FLOOR_GBS:,.0f} GB/s")
    header = (f"{'model':<14}{'matrix':<9}{'N x K':>13}{'M':>3}{'MB':>8}{'ours us':>9}{'cuBLAS us':>10}"
              f"{'speedup':>8}{'ours GB/s':>10}{'of floor':>9}{'cuBLAS':>8}{'max err':>9}")
    print(header)
    results, step = [], {}
    for model, name, n, k, bias, layers in MATRICES:
        ws, b, nbytes = weights(n, k, bias, dtype)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            err = (kernels.gemv(x, ws[0], b).float() - reference.gemv(x, ws[0], b).float()).abs().max().item()
            ours, cublas = time_us("gemv", x, ws, b), time_us("cublas", x, ws, b)
            gbs = nbytes / ours / 1e3
            cublas_frac = nbytes / cublas / 1e3 / COPY_FLOOR_GBS
            print(f"{model:<14}{name:<9}{f'{n} x {k}':>13}{m:>3}{nbytes / 1e6:>8.1f}{ours:>9.2f}{cublas:>10.2f}"
                  f"{cublas / ours:>7.2f}x{gbs:>10.0f}{gbs / COPY_FLOOR_GBS:>9.1%}{cublas_frac:>8.1%}{err:>9.1e}")
            results.append({"model": model, "matrix": name, "n": n, "k": k, "m": m, "bytes": nbytes, "ours_us": ours,
                            "cublas_us": cublas, "gbs": gbs, "fraction": gbs / COPY_FLOOR_GBS, "max_err": err})
            mine, theirs = step.get((model, m), (0.0, 0.0))
            step[(model, m)] = (mine + ours * layers, theirs + cublas * layers)
        del ws
    print("\nlinear layers of one decode step (all layers and the lm_head):")
    for (model, m), (mine, theirs) in step.items():
        print(f"  {model:<14} M={m}: ours {mine:8.1f} us, cuBLAS {theirs:8.1f} us ({theirs / mine:.2f}x)")
    if args.quick:
        return 0

    print("\ndown projection with the gated activation (x = [gate | up], silu):")
    print(f"{'model':<14}{'N x K':>13}{'M':>3}{'fused us':>9}{'act+cuBLAS':>11}{'act+gemv':>9}{'fused GB/s':>11}"
          f"{'of floor':>9}{'max err':>9}")
    fused_results = []
    for model, name, n, k, bias, _ in MATRICES:
        if name != "down":
            continue
        ws, b, nbytes = weights(n, k, bias, dtype)
        for m in args.rows:
            x = torch.randn(m, 2 * k, device="cuda").to(dtype)
            err = (kernels.gemv(x, ws[0], b, "silu").float()
                   - reference.gemv(x, ws[0], b, "silu").float()).abs().max().item()
            fused, act_cublas = time_us("fused", x, ws, b), time_us("act+cublas", x, ws, b)
            act_gemv = time_us("act+gemv", x, ws, b)
            gbs = nbytes / fused / 1e3
            print(f"{model:<14}{f'{n} x {k}':>13}{m:>3}{fused:>9.2f}{act_cublas:>11.2f}{act_gemv:>9.2f}{gbs:>11.0f}"
                  f"{gbs / COPY_FLOOR_GBS:>9.1%}{err:>9.1e}")
            fused_results.append({"model": model, "n": n, "k": k, "m": m, "fused_us": fused,
                                  "act_cublas_us": act_cublas, "act_gemv_us": act_gemv, "max_err": err})
        del ws

    names = [v for v in VARIANTS if v != "auto"]
    print("\ngemv kernel variants, us per call (best marked *; 'of floor' is the best's fraction):")
    print(f"{'model':<14}{'matrix':<9}{'N x K':>13}{'M':>3}" + "".join(f"{v:>14}" for v in names) + f"{'of floor':>9}")
    variant_results = []
    for model, name, n, k, bias, _ in MATRICES:
        ws, b, nbytes = weights(n, k, bias, dtype)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            times = {v: time_us(v, x, ws, b) for v in names}
            best = min(times, key=times.get)
            cells = "".join(f"{times[v]:>13.2f}{'*' if v == best else ' '}" for v in names)
            frac = nbytes / times[best] / 1e3 / COPY_FLOOR_GBS
            print(f"{model:<14}{name:<9}{f'{n} x {k}':>13}{m:>3}{cells}{frac:>9.1%}")
            variant_results.append({"model": model, "matrix": name, "n": n, "k": k, "m": m, "us": times})
        del ws

    print("\nbehind the kernel that writes x (fused_add_rms_norm -> gemv, PDL on): marginal us of the gemv = "
          "pair - norm alone (best marked *; 'of floor' = floor / best); act: SiLU on x (silu>), on the output "
          "(>silu: gate_up writing SiLU(gate) * up) or none; a gated output always runs the row-group kernel")
    print(f"{'model':<14}{'matrix':<9}{'act':>6}{'N x K':>13}{'M':>3}{'norm us':>8}"
          + "".join(f"{v:>14}" for v in names) + f"{'floor us':>9}{'of floor':>9}")
    chain_results = []
    for model, name, n, k, bias, _ in MATRICES:
        ws, b, nbytes = weights(n, k, bias, dtype)
        acts = {"down": [("silu", None), (None, None)],
                "gate_up": [(None, None), (None, "silu")]}.get(name, [(None, None)])
        for activation, output_activation in acts:
            label = "silu>" if activation else (">silu" if output_activation else "-")
            for m in [r for r in args.rows if r <= 2]:
                x = torch.randn(m, k if activation is None else 2 * k, device="cuda").to(dtype)
                if output_activation is not None:
                    got = gemv_variant(x, ws[0], b, None, "auto", output_activation).float()
                    want = reference.gemv(x, ws[0], b, None, output_activation).float()
                    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item() + 1e-3, "gated output"
                norm = chain_us("norm", x, ws, b, activation, output_activation)
                variants = names if output_activation is None else ["row_group_32", "row_group_16", "row_group_8"]
                marginal = {v: chain_us(v, x, ws, b, activation, output_activation) - norm for v in variants}
                best = min(marginal, key=marginal.get)
                cells = "".join(f"{marginal[v]:>13.2f}{'*' if v == best else ' '}" if v in marginal else f"{'-':>14}"
                                for v in names)
                floor = nbytes / H200.bandwidth * 1e6
                print(f"{model:<14}{name:<9}{label:>6}{f'{n} x {k}':>13}{m:>3}{norm:>8.2f}{cells}{floor:>9.2f}"
                      f"{floor / max(marginal[best], 1e-9):>9.1%}")
                chain_results.append({"model": model, "matrix": name, "act": label, "n": n, "k": k, "m": m,
                                      "norm_us": norm, "marginal_us": marginal, "floor_us": floor})
        del ws
    if args.json:
        print(json.dumps({"dtype": args.dtype, "gemv": results, "down_fused": fused_results,
                          "variants": variant_results, "behind_norm": chain_results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
