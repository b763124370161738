"""Which of a prefill step's cuBLAS GEMMs run faster as k row chunks than as one call? (session 19)

experiments/mlp_chunk_probe.py found the 8B MLP at 8,448 rows 1.7% faster as two 4,224-row chunks: cuBLAS picks
its kernel by shape, and 4,224 = 33 x 128 rows fills whole waves of 128 x 256 tiles for every Llama-3.1-8B
projection. This times each projection alone (o and down adding into the residual, as the engine calls them),
whole against k chunks, a separate weight per layer, CUDA graphs, rounds alternating, us per call (median).

    python experiments/gemm_split_probe.py [--rows 8448] [--splits 1,2,3,4,6]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.bench.timing import cuda_time_ms  # noqa: E402
from wllm.engine.cuda_graphs import capture_graph  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=8448)
p.add_argument("--splits", default="1,2,3,4,6")
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--shape", default="8b", choices=["8b", "0.5b"])
args = p.parse_args()

dev, dt, M, L = "cuda", torch.bfloat16, args.rows, 4
# name: (N, K, adds into the residual)
SHAPES = {"8b": {"qkv": (6144, 4096, False), "o": (4096, 4096, True), "gate_up": (28672, 4096, False),
                 "down": (4096, 14336, True)},
          "0.5b": {"qkv": (1152, 896, False), "o": (896, 896, True), "gate_up": (9728, 896, False),
                   "down": (896, 4864, True)}}[args.shape]
torch.manual_seed(0)


def case(n: int, k: int, residual: bool, chunk: int):
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    x = torch.randn(M, k, device=dev, dtype=dt)
    y = torch.zeros(M, n, device=dev, dtype=dt)

    def run() -> None:
        for w in ws:
            for i in range(0, M, chunk):
                if residual:
                    y[i : i + chunk].addmm_(x[i : i + chunk], w.t())
                else:
                    torch.mm(x[i : i + chunk], w.t(), out=y[i : i + chunk])

    return run


rows = []
for name, (n, k, res) in SHAPES.items():
    graphs = {}
    for s in (int(v) for v in args.splits.split(",")):
        chunk = -(-M // s)
        graphs[s] = (chunk, capture_graph(case(n, k, res, chunk))[0])
    times = {s: [] for s in graphs}
    for _ in range(args.rounds):
        for s, (_, g) in graphs.items():
            times[s].append(cuda_time_ms(g.replay, 1, 3) * 1e3 / L)
    base = statistics.median(times[1]) if 1 in times else None
    for s, t in times.items():
        med = statistics.median(t)
        tf = 2 * M * n * k / med / 1e6
        rel = f"{med / base:.3f}x" if base else ""
        print(f"M={M} {name:<8} {s} x {graphs[s][0]:<5} {med:8.1f} us  {rel:>7}  {tf:6.1f} TFLOP/s  (min {min(t):.1f})")
    del graphs
    torch.cuda.empty_cache()
