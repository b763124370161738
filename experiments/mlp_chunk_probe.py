"""Does a prefill step's MLP gain from running in row chunks whose intermediates stay in L2? (session 19)

At the 8B batch's 8,448-row prefill steps, gate_up writes a [8448, 2 x 14336] bf16 intermediate (484 MB) that
the activation kernel reads back from HBM and halves (242 MB) for the down projection to read: ~0.1 s of the
batch's 4.5 s in the activation kernel alone, at its bandwidth floor. Run in chunks of c rows, with one
c-row intermediate buffer reused by every chunk, the intermediate (c x 56 KB: 58 MB at 1,056 rows) could be
written, read and overwritten inside the 50 MB L2 and seldom reach HBM -- if the GEMMs at c rows keep their
per-row speed (their wave quantisation changes with c). Llama-3.1-8B MLP (4096 -> 2 x 14336 -> 4096), bf16,
a separate weight set per layer, down adding into the residual (beta = 1) as the engine does; CUDA graphs,
rounds alternate the cases, us per layer (median).

    python experiments/mlp_chunk_probe.py [--rows 8448] [--chunks 528,704,1056,...]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm.bench.timing import assert_cases_agree, cuda_time_ms  # noqa: E402
from wllm.engine.cuda_graphs import capture_graph  # noqa: E402
from wllm.kernels import ops  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=8448)
p.add_argument("--chunks", default="512,528,704,768,1024,1056,1408,2112,4224")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--rounds", type=int, default=9)
args = p.parse_args()

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
H, INTER, L, M = 4096, 14336, args.layers, args.rows
layers = [(torch.randn(2 * INTER, H, device=dev, dtype=dt) * 0.02, torch.randn(H, INTER, device=dev, dtype=dt) * 0.02)
          for _ in range(L)]
x = torch.randn(M, H, device=dev, dtype=dt)
y = torch.zeros(M, H, device=dev, dtype=dt)
gu_full = torch.empty(M, 2 * INTER, device=dev, dtype=dt)
h_full = torch.empty(M, INTER, device=dev, dtype=dt)


def whole() -> None:
    for wgu, wd in layers:
        torch.mm(x, wgu.t(), out=gu_full)
        ops._cuda_act_and_mul(gu_full, "silu", out=h_full)
        y.addmm_(h_full, wd.t())


def chunked(c: int, down_too: bool):
    gu = torch.empty(c, 2 * INTER, device=dev, dtype=dt)
    h = torch.empty(c, INTER, device=dev, dtype=dt)

    def run() -> None:
        for wgu, wd in layers:
            for i in range(0, M, c):
                j = min(M, i + c)
                g, a = gu[: j - i], (h[: j - i] if down_too else h_full[i:j])
                torch.mm(x[i:j], wgu.t(), out=g)
                ops._cuda_act_and_mul(g, "silu", out=a)
                if down_too:
                    y[i:j].addmm_(a, wd.t())
            if not down_too:
                y.addmm_(h_full, wd.t())

    return run


cases = {"whole": whole}
for c in (int(s) for s in args.chunks.split(",")):
    if c < M:
        cases[f"chunks of {c}, whole MLP"] = chunked(c, True)
        cases[f"chunks of {c}, gate_up+act"] = chunked(c, False)

assert_cases_agree(cases, y, 1e-2)
graphs = {name: capture_graph(fn)[0] for name, fn in cases.items()}
times: dict[str, list[float]] = {name: [] for name in graphs}
for _ in range(args.rounds):
    for name, g in graphs.items():
        times[name].append(cuda_time_ms(g.replay, 1, 3) * 1e3 / L)
base = statistics.median(times["whole"])
flop = 2 * M * H * 3 * INTER
for name, t in times.items():
    med = statistics.median(t)
    print(f"M={M} {name:<30} {med:9.1f} us per layer  {med / base:.3f}x  {flop / med / 1e6:6.1f} TFLOP/s  "
          f"(min {min(t):.1f})")
