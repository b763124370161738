"""Programmatic Dependent Launch: a batch-1 decode step's kernel chain with PDL off and on.

Each layer runs the engine's decode kernels back to back -- fused_add_rms_norm, gemv (qkv), rotary_and_cache,
paged_decode_attention, gemv (o), fused_add_rms_norm, gemv (gate_up writing SiLU(gate) * up), gemv (down) --
or, with the activation in the down projection instead (rows "act in down": gate_up writes [gate | up] and
every CTA of down applies SiLU-and-mul to its copy), as the engine did before session 4 -- with its
own weights (so they stream from DRAM as in a real step, not from L2), all `--layers` layers captured in
one CUDA graph, once with PDL off and once on. PDL lets each kernel fetch what its predecessor does not
write (weights, block tables, older K/V rows) while that predecessor finishes. Rows: device time per
layer; floor = the layer's weight and KV bytes at the H200's copy bandwidth. Outputs of the two graphs
are checked to be bit-identical.

With `--ablate`, the PDL-on chain is also timed with each kernel left out in turn (its output replaced by a
tensor made before the graph): the difference to the whole chain is what that kernel adds to a layer
(its own time less what PDL hides of it), which per-kernel profiler durations do not show under PDL.

    python benchmarks/kernels_pdl.py [--context 128] [--layers 24] [--ablate] [--json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import cuda_time_ms
from wllm.engine.cuda_graphs import capture_graph

# name: hidden, q heads, kv heads, head size, intermediate, qkv bias
SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864, True), "llama-3.1-8b": (4096, 32, 8, 128, 14336, False)}
BLOCK = 16


KERNELS = ("norm_in", "qkv", "rope_cache", "attention", "o", "norm_post", "gate_up", "down")


def build_chain(name: str, context: int, layers: int, gated: bool = True, attn_splits: int = 0,
                max_seq_len: int | None = None, device: str = "cuda",
                ) -> tuple[Callable[..., torch.Tensor], dict[str, torch.Tensor | None]]:
    """The batch-1 decode layer chain of `name`: returns step(skip) -- `layers` layers with their own
    weights, each kernel left out when named in `skip` (a name or a frozenset) -- and layer 0's weights.
    max_seq_len sizes decode attention's split-KV grid as the engine's max_model_len does (None: the
    context rounded up to whole blocks; the engine captures its graphs for max_model_len, e.g. 4096,
    which gives batch 1 many more splits)."""
    hidden, hq, hkv, d, inter, bias = SHAPES[name]
    dt, dev = torch.bfloat16, device

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=dt) * k**-0.5

    blocks = (max(context, max_seq_len or 0) + BLOCK - 1) // BLOCK
    max_seq_len = blocks * BLOCK
    weights = [{
        "norm_in": torch.ones(hidden, device=dev, dtype=dt), "norm_post": torch.ones(hidden, device=dev, dtype=dt),
        "qkv": w((hq + 2 * hkv) * d, hidden),
        "qkv_bias": torch.zeros((hq + 2 * hkv) * d, device=dev, dtype=dt) if bias else None,
        "o": w(hidden, hq * d), "gate_up": w(2 * inter, hidden), "down": w(hidden, inter),
        "k_cache": torch.randn(blocks + 1, BLOCK, hkv, d, device=dev, dtype=dt),
        "v_cache": torch.randn(blocks + 1, BLOCK, hkv, d, device=dev, dtype=dt),
    } for _ in range(layers)]
    tables = torch.randperm(blocks + 1, device=dev)[:blocks].to(torch.int32).view(1, blocks)
    seq_lens = torch.tensor([context], device=dev, dtype=torch.int32)
    positions = torch.tensor([context - 1], device=dev, dtype=torch.int64)
    slots = (tables[0, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK).view(1)
    cos_sin = kernels.rotary_cos_sin_cache(max_seq_len, d).to(dev)
    ws = kernels.decode_workspace_size(1, hq, hkv, d, max_seq_len)
    workspace = torch.zeros(max((ws + 3) // 4, 1), device=dev, dtype=torch.float32)
    x0 = torch.randn(1, hidden, device=dev, dtype=dt)

    # Stand-ins for a left-out kernel's output (ablation).
    qkv_fixed = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    attn_fixed = torch.randn(1, hq, d, device=dev, dtype=dt)
    gate_up_fixed = torch.randn(1, inter if gated else 2 * inter, device=dev, dtype=dt)

    def step(skip: str | frozenset[str] | None = None) -> torch.Tensor:
        skipped = skip if isinstance(skip, frozenset) else frozenset((skip,) if skip else ())
        x, residual = x0.clone(), torch.zeros_like(x0)
        for lw in weights:
            if "norm_in" not in skipped:
                kernels.fused_add_rms_norm(x, residual, lw["norm_in"], 1e-6)
            qkv = qkv_fixed if "qkv" in skipped else kernels.gemv(x, lw["qkv"], lw["qkv_bias"])
            q, k, v = (t.view(1, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
            if "rope_cache" not in skipped:
                kernels.rotary_and_cache(positions, q, k, v, lw["k_cache"], lw["v_cache"], slots, cos_sin, True)
            attn = attn_fixed if "attention" in skipped else kernels.paged_decode_attention(
                q, lw["k_cache"], lw["v_cache"], tables, seq_lens, d**-0.5, max_seq_len=max_seq_len,
                num_splits=attn_splits, workspace=workspace)
            x = x if "o" in skipped else kernels.gemv(attn.reshape(1, hq * d), lw["o"])
            if "norm_post" not in skipped:
                kernels.fused_add_rms_norm(x, residual, lw["norm_post"], 1e-6)
            if gated:
                h = gate_up_fixed if "gate_up" in skipped else kernels.gemv(x, lw["gate_up"], output_activation="silu")
                x = x if "down" in skipped else kernels.gemv(h, lw["down"])
            else:
                gate_up = gate_up_fixed if "gate_up" in skipped else kernels.gemv(x, lw["gate_up"])
                x = x if "down" in skipped else kernels.gemv(gate_up, lw["down"], activation="silu")
        return x

    return step, weights[0]


def case(name: str, context: int, layers: int, ablate: bool = False, gated: bool = True,
         skip_sets: tuple[frozenset[str], ...] = (), attn_splits: int = 0, max_seq_len: int | None = None) -> dict:
    """Time one shape's chain with PDL off and on; returns one result row. gated: the activation at the
    gate_up projection's outputs (the engine's default), else in the down projection. skip_sets: further
    ablations leaving out several kernels at once; attn_splits: decode attention's split count (0: auto);
    max_seq_len: as in build_chain."""
    hkv, d = SHAPES[name][2], SHAPES[name][3]
    step, lw = build_chain(name, context, layers, gated, attn_splits, max_seq_len)
    us, outs = {}, {}
    for label, on in (("off", False), ("on", True)):
        previous = kernels.set_pdl(on)
        try:
            graph, out = capture_graph(step)
        finally:
            kernels.set_pdl(previous)
        us[label] = cuda_time_ms(graph.replay, warmup=5, iters=50) * 1e3 / layers
        outs[label] = out.clone()
    marginal = {}
    if ablate:
        for kernel in KERNELS:
            graph, _ = capture_graph(lambda kernel=kernel: step(kernel))
            marginal[kernel] = us["on"] - cuda_time_ms(graph.replay, warmup=5, iters=50) * 1e3 / layers
    for skip_set in skip_sets:
        graph, _ = capture_graph(lambda skip_set=skip_set: step(skip_set))
        marginal["+".join(sorted(skip_set))] = us["on"] - cuda_time_ms(graph.replay, warmup=5, iters=50) * 1e3 / layers
    nbytes = sum(t.numel() * t.element_size() for key, t in lw.items() if t is not None and "cache" not in key)
    nbytes += 2 * context * hkv * d * 2  # K and V rows read
    return {"shape": name, "mlp": "act at gate_up" if gated else "act in down", "context": context,
            "pdl_off_us": us["off"], "pdl_on_us": us["on"], "bytes": nbytes,
            "floor_us": nbytes / H200.bandwidth * 1e6, "identical": bool(torch.equal(outs["off"], outs["on"])),
            "marginal_us": marginal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=128, help="tokens of context, the new one included")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers per captured graph")
    parser.add_argument("--ablate", action="store_true", help="also time the chain with each kernel left out")
    parser.add_argument("--json", action="store_true", help="also print one JSON line of results")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="only this shape (default: all)")
    parser.add_argument("--skip-sets", default="", help="comma-separated kernel sets joined by '+' to leave out "
                        "together (e.g. norm_in+norm_post), with --ablate")
    parser.add_argument("--attn-splits", type=int, default=0, help="decode attention splits (0: automatic)")
    parser.add_argument("--max-seq-len", type=int, help="size the split-KV grid for this length, as the engine "
                        "does for max_model_len (default: the context)")
    args = parser.parse_args()
    skip_sets = tuple(frozenset(part.split("+")) for part in args.skip_sets.split(",") if part)
    unknown = {k for ks in skip_sets for k in ks} - set(KERNELS)
    if unknown:
        raise SystemExit(f"--skip-sets: unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    if not torch.cuda.is_available() or not kernels.available():
        raise SystemExit("needs a CUDA GPU and the wLLM kernel library")
    torch.manual_seed(0)
    shapes = [args.shape] if args.shape else list(SHAPES)
    rows = [case(name, args.context, args.layers, args.ablate and gated, gated,
                 skip_sets if args.ablate and gated else (), args.attn_splits, args.max_seq_len) for name in shapes
            for gated in (True, False)]
    print(f"batch-1 decode layer (8 kernels), bf16, context {args.context}, CUDA graph of {args.layers} layers; "
          f"floor = weight + KV bytes at {H200.bandwidth / 1e9:,.0f} GB/s")
    print(f"{'shape':<14}{'MLP':<16}{'PDL off us':>12}{'PDL on us':>11}{'saved us':>10}{'floor us':>10}"
          f"{'on/floor':>10}{'identical':>11}")
    for r in rows:
        saved = r["pdl_off_us"] - r["pdl_on_us"]
        print(f"{r['shape']:<14}{r['mlp']:<16}{r['pdl_off_us']:>12.2f}{r['pdl_on_us']:>11.2f}{saved:>10.2f}{r['floor_us']:>10.2f}"
              f"{r['pdl_on_us'] / r['floor_us']:>9.2f}x{str(r['identical']):>11}")
    if args.ablate:
        print("\nwhat each kernel adds to a layer with PDL on (us): whole chain minus the chain without it")
        print(f"{'shape':<14}" + "".join(f"{k:>11}" for k in KERNELS))
        for r in (r for r in rows if r["marginal_us"]):
            print(f"{r['shape']:<14}" + "".join(f"{r['marginal_us'][k]:>11.2f}" for k in KERNELS))
        for r in (r for r in rows if r["marginal_us"]):
            for key, value in r["marginal_us"].items():
                if key not in KERNELS:
                    print(f"{r['shape']:<14}left out together: {key:<40}{value:>9.2f}")
    if args.json:
        print(json.dumps({"context": args.context, "layers": args.layers, "rows": rows}))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
