"""Sampler kernel time: microseconds per call inside a CUDA graph, against the bytes floor.

Rows: batch 1 over 151,936 and 128,256 logits (Qwen2.5 / Llama-3 vocabularies), batch 64 and 256 over
128,256; greedy, temperature 0.8 + top_p 0.95, and temperature 0.8 + top_k 50 + top_p 0.95. Each graph
holds `--calls` back-to-back sampler calls, so the graph launch itself is spread over them (the decode
graph has the sampler inside a longer graph too). The floor is one read of the fp32 logits at the
H200's copy bandwidth (wllm.bench.floors); a filtered row needs a few passes, later ones mostly from L2.

    python benchmarks/kernels_sampling.py [--calls 20] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from wllm import kernels
from wllm.bench.floors import H200
from wllm.bench.timing import graph_us, kernel_bench_args
from wllm.kernels import reference
from wllm.sampling_params import SamplingParams

SHAPES = [(1, 151936), (1, 128256), (64, 128256), (256, 128256)]
MODES = {"greedy": {"temperature": 0.0}, "t0.8 top_p0.95": {"temperature": 0.8, "top_p": 0.95},
         "t0.8 top_k50 top_p0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95}}


class _Row:
    """A minimal sampling row (what pack_sampling_rows reads)."""

    def __init__(self, seed: int, **params: float) -> None:
        self.params = SamplingParams(**params)
        self.seed, self.index = seed, 0
        self.prompt_token_ids, self.output_token_ids, self.eos_token_ids = [], [7] * seed, []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="sampler calls per captured graph")
    args = kernel_bench_args(parser)
    results = []
    print(f"sampler, fp32 logits, us per call in a CUDA graph ({args.calls} calls per graph); floor = one read "
          f"at {H200.bandwidth / 1e9:,.0f} GB/s")
    print(f"{'rows x vocab':<16}{'mode':<26}{'us':>9}{'floor us':>10}{'of floor':>10}{'GB/s':>8}  check")
    for rows, vocab in SHAPES:
        # Logits shaped like a model's: a few likely tokens over a long tail.
        logits = torch.randn(rows, vocab, device="cuda") * 2.5
        floor_us = rows * vocab * 4 / H200.bandwidth * 1e6
        for mode, params in MODES.items():
            packed = kernels.pack_sampling_rows([_Row(i, **params) for i in range(rows)], "cuda")
            us = graph_us(lambda logits=logits, packed=packed: [kernels.sample(logits, **packed)
                                                                for _ in range(args.calls)], args.calls)
            check_rows = min(rows, 4)  # the reference is slow on the CPU side; a few rows suffice
            want, _, _ = reference.sample(logits[:check_rows], packed["params_f32"][:check_rows],
                                          packed["params_i64"][:check_rows])
            got, _, _ = kernels.sample(logits, **packed)
            ok = "ok" if torch.equal(got[:check_rows].cpu(), want.cpu()) else "MISMATCH"
            gbs = rows * vocab * 4 / us / 1e3
            results.append({"rows": rows, "vocab": vocab, "mode": mode, "us": us, "floor_us": floor_us,
                            "gbs": gbs, "check": ok})
            print(f"{f'{rows} x {vocab}':<16}{mode:<26}{us:>9.1f}{floor_us:>10.1f}{floor_us / us:>10.1%}"
                  f"{gbs:>8.0f}  {ok}")
    if args.json:
        print(json.dumps({"sampling": results}))
    return 0 if all(r["check"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
