"""Can a decode step overlap its memory-bound attention with compute-bound GEMMs on this GPU?
Llama-3.1-8B decode shapes at 240 sequences x 576 tokens: per "layer" one paged decode attention (its own
KV cache, ~600 MB) and the qkv + o projections (their own weights). Times L layers of: attention only,
GEMMs only, both in sequence, and both on two streams (attention of a layer beside unrelated GEMMs), in
CUDA graphs and eagerly, with the GEMM stream at normal or high priority. us per layer."""

import torch

from wllm import kernels
from wllm.bench.timing import cuda_time_ms, graph_us

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
S, ctx, hq, hkv, d, bs, L = 240, 576, 32, 8, 128, 16, 6
bps = ctx // bs
nb = S * bps
layers = []
for _ in range(L):
    layers.append(
        dict(
            k=torch.randn(nb, bs, hkv, d, device=dev, dtype=dt),
            v=torch.randn(nb, bs, hkv, d, device=dev, dtype=dt),
            t=torch.randperm(nb, device=dev).view(S, bps).to(torch.int32),
            wqkv=torch.randn(6144, 4096, device=dev, dtype=dt) * 0.02,
            wo=torch.randn(4096, 4096, device=dev, dtype=dt) * 0.02,
            wgu=torch.randn(28672, 4096, device=dev, dtype=dt) * 0.02,
        )
    )
lens = torch.full((S,), ctx, dtype=torch.int32, device=dev)
q = torch.randn(S, hq, d, device=dev, dtype=dt)
o_attn = torch.empty_like(q)
x = torch.randn(S, 4096, device=dev, dtype=dt)
y1 = torch.empty(S, 6144, device=dev, dtype=dt)
y2 = torch.empty(S, 4096, device=dev, dtype=dt)
y3 = torch.empty(S, 28672, device=dev, dtype=dt)


def attn(i):
    lw = layers[i]
    kernels.paged_decode_attention(q, lw["k"], lw["v"], lw["t"], lens, d**-0.5, max_seq_len=ctx, out=o_attn)


def gemm(i, mlp=False):
    lw = layers[i]
    torch.mm(x, lw["wqkv"].t(), out=y1)
    torch.mm(x, lw["wo"].t(), out=y2)
    if mlp:
        torch.mm(x, lw["wgu"].t(), out=y3)


def two_streams(side, mlp):
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for i in range(L):
            attn(i)
        with torch.cuda.stream(side):
            for i in range(L):
                gemm(i, mlp)
        main.wait_stream(side)

    return run


def time_us(fn, graph):
    """us per layer of fn (L layers): replayed from a CUDA graph, or launched eagerly."""
    return graph_us(fn, L, 3, 15) if graph else cuda_time_ms(fn, 3, 15) * 1e3 / L


lo, hi = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
for mlp in (False, True):
    cases = {
        "attention": lambda: [attn(i) for i in range(L)],
        "gemms": lambda mlp=mlp: [gemm(i, mlp) for i in range(L)],
        "sequence": lambda mlp=mlp: [(attn(i), gemm(i, mlp)) for i in range(L)],
        "2 streams": two_streams(lo, mlp),
        "2 streams, GEMMs high priority": two_streams(hi, mlp),
    }
    print(f"-- GEMMs: qkv + o{' + gate_up' if mlp else ''} (M = {S})")
    for name, fn in cases.items():
        print(f"{name:<32} graph {time_us(fn, True):8.1f}   eager {time_us(fn, False):8.1f} us per layer")
