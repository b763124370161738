"""At decode sizes (M ~240 rows) cuBLAS's tiles leave the last wave of SMs part-empty (the 8B batch's decode
gate_up: 224 CTAs of 256 x 128 on 132 SMs, the second wave 70% full). Does cutting a projection along N into
two GEMMs sized to the waves -- one of whole waves, one that cuBLAS may tile differently -- take less time than
the whole GEMM, on one stream or on two? Llama-3.1-8B projections, bf16, a separate weight per layer, CUDA
graphs, us per layer. Usage: python experiments/decode_gemm_wave_probe.py [SHAPE ...] [M ...]"""

import statistics
import sys

import torch

from wllm.bench.timing import assert_cases_agree, cuda_time_ms
from wllm.engine.cuda_graphs import capture_graph

dev, dt = "cuda", torch.bfloat16
L = 6
# name: (N, K, step of the cut along N)
SHAPES = {"gate_up": (28672, 4096, 256), "down": (4096, 14336, 128), "qkv": (6144, 4096, 128), "o": (4096, 4096, 128)}


def run_shape(name: str, m: int) -> None:
    n, k, step = SHAPES[name]
    torch.manual_seed(0)
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(L)]
    x = torch.randn(m, k, device=dev, dtype=dt)
    y = torch.empty(m, n, device=dev, dtype=dt)
    side = torch.cuda.Stream()

    def whole():
        for w in ws:
            torch.mm(x, w.t(), out=y)

    def cut(a: int, streams: int):
        # the two pieces write column ranges of the one output, as the layer would (views with the row stride n)
        pieces = [(slice(0, a), y[:, :a]), (slice(a, n), y[:, a:])]

        def run():
            main = torch.cuda.current_stream()
            if streams == 2:
                side.wait_stream(main)
            for w in ws:
                for i, (rows, out) in enumerate(pieces):
                    with torch.cuda.stream(side if streams == 2 and i == 1 else main):
                        torch.mm(x, w[rows].t(), out=out)
            if streams == 2:
                main.wait_stream(side)

        return run

    cases = {"whole": whole}
    for a in range(step, n, step):
        for s in (1, 2):
            cases[f"{a}+{n - a} s{s}"] = cut(a, s)
    assert_cases_agree(cases, y, 2e-2)  # each column is one GEMM's over all of K, whichever the cut
    graphs = {c: capture_graph(fn)[0] for c, fn in cases.items()}
    times = {c: [] for c in graphs}
    for _ in range(5):
        for c, g in graphs.items():
            times[c].append(cuda_time_ms(g.replay, 1, 3) * 1e3 / L)
    med = {c: statistics.median(t) for c, t in times.items()}
    base = med["whole"]
    for s in (1, 2):
        best = sorted((t, c) for c, t in med.items() if c.endswith(f"s{s}"))[:4]
        print(
            f"{name:<8} M={m:<4} whole {base:7.1f} us | best cuts: "
            + ", ".join(f"{c} {t:.1f} ({t / base:.3f}x)" for t, c in best),
            flush=True,
        )


shapes = [a for a in sys.argv[1:] if a in SHAPES] or list(SHAPES)
for m in [int(a) for a in sys.argv[1:] if a not in SHAPES] or [240, 256]:
    for shape in shapes:
        run_shape(shape, m)
