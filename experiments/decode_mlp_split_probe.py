"""Do the decode step's MLP GEMMs (M ~240, where cuBLAS leaves SMs idle in its last wave) gain from being
cut along the intermediate dimension into pieces run on two streams, so one piece's GEMM fills the SMs the
other's leaves idle? Llama-3.1-8B MLP (4096 -> 2 x 14336 -> 4096), bf16, a separate weight set per layer,
down_proj adding into the residual (beta = 1; the pieces' adds are kept in order by an event). us per layer,
CUDA graphs. Usage: python experiments/decode_mlp_split_probe.py [M ...]"""

import statistics
import sys

import torch

from wllm.bench.timing import assert_cases_agree, cuda_time_ms
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import ops

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
H, INTER, L = 4096, 14336, 6
layers = [
    dict(
        wgu=torch.randn(2 * INTER, H, device=dev, dtype=dt) * 0.02,
        wd=torch.randn(H, INTER, device=dev, dtype=dt) * 0.02,
    )
    for _ in range(L)
]


def pieces(w_gu: torch.Tensor, w_d: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Piece c: its gate and up rows stacked (a copy, as a load-time reorder would make) and its down columns
    (a strided view)."""
    c = INTER // n
    out = []
    for k in range(n):
        gu = torch.cat([w_gu[k * c : (k + 1) * c], w_gu[INTER + k * c : INTER + (k + 1) * c]]).contiguous()
        out.append((gu, w_d[:, k * c : (k + 1) * c]))
    return out


def run_case(m: int) -> None:
    x = torch.randn(m, H, device=dev, dtype=dt)
    y = torch.zeros(m, H, device=dev, dtype=dt)
    split = {n: [pieces(lw["wgu"], lw["wd"], n) for lw in layers] for n in (2, 4)}
    bufs = {
        n: [
            (torch.empty(m, 2 * INTER // n, device=dev, dtype=dt), torch.empty(m, INTER // n, device=dev, dtype=dt))
            for _ in range(n)
        ]
        for n in (1, 2, 4)
    }
    side = torch.cuda.Stream()

    def whole():
        gu, h = bufs[1][0]
        for lw in layers:
            torch.mm(x, lw["wgu"].t(), out=gu)
            ops._cuda_act_and_mul(gu, "silu", out=h)
            y.addmm_(h, lw["wd"].t())

    def piece(lw_pieces, k, n):
        gu, h = bufs[n][k]
        w_gu, w_d = lw_pieces[k]
        torch.mm(x, w_gu.t(), out=gu)
        ops._cuda_act_and_mul(gu, "silu", out=h)
        return h, w_d

    def one_stream(n):
        def run():
            for lp in split[n]:
                for k in range(n):
                    h, w_d = piece(lp, k, n)
                    y.addmm_(h, w_d.t())

        return run

    def two_streams(n):
        def run():
            main = torch.cuda.current_stream()
            for lp in split[n]:
                side.wait_stream(main)
                done = []
                for k in range(n):
                    s = main if k % 2 == 0 else side
                    with torch.cuda.stream(s):
                        h, w_d = piece(lp, k, n)
                        if done:  # the residual adds stay in order
                            s.wait_event(done[-1])
                        y.addmm_(h, w_d.t())
                        ev = torch.cuda.Event()
                        ev.record(s)
                        done.append(ev)
                main.wait_stream(side)

        return run

    cases = {
        "whole": whole,
        "2 pieces, 1 stream": one_stream(2),
        "2 pieces, 2 streams": two_streams(2),
        "4 pieces, 1 stream": one_stream(4),
        "4 pieces, 2 streams": two_streams(4),
    }
    # Same result as the whole MLP (fp32 accumulation differs only by the split of the sum).
    assert_cases_agree(cases, y, 2e-2)
    graphs = {name: capture_graph(fn)[0] for name, fn in cases.items()}
    times = {name: [] for name in graphs}
    for _ in range(7):  # rounds alternate the cases, so clock drift hits them alike
        for name, g in graphs.items():
            times[name].append(cuda_time_ms(g.replay, 1, 3) * 1e3 / L)
    base = statistics.median(times["whole"])
    for name, t in times.items():
        print(f"M={m:<5} {name:<22} {statistics.median(t):8.1f} us per layer  {statistics.median(t) / base:.3f}x")


for m in [int(a) for a in sys.argv[1:]] or [240, 128, 64]:
    run_case(m)
