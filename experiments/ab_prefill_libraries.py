"""In-process A/B of kernel libraries on paged prefill attention: every library is loaded into this one
process (its own ctypes handle), each case is captured as a CUDA graph of `calls` back-to-back calls per
library, and the graphs are replayed in rotation for several rounds, so clocks and power drift hit every
library alike. Usage: python experiments/ab_prefill_libraries.py NAME=PATH [NAME=PATH ...]
AB_NO_CHECK=1 skips the check that every library's output matches the first one's (for probe builds that
leave a stage out on purpose, to time it by difference); AB_CASES=16x512,1x4096 picks cases."""

import ctypes
import os
import statistics
import sys

import torch

from wllm import kernels
from wllm.bench.timing import cuda_time_ms
from wllm.engine.cuda_graphs import capture_graph
from wllm.kernels import _lib

libs = dict(a.split("=", 1) for a in sys.argv[1:])
bindings = {}
for name, path in libs.items():
    _lib._cdll = ctypes.CDLL(path)
    _lib._bindings.clear()
    bindings[name] = _lib.binding(0)


def case(s, n, hq=32, hkv=8, d=128, bs=16, dev="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)
    bps = (n + bs - 1) // bs
    nb = s * bps
    tables = torch.randperm(nb, device=dev, generator=g).view(s, bps).to(torch.int32)
    k_cache = torch.randn(nb, bs, hkv, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(s * n, hq, d, device=dev, dtype=dtype, generator=g)
    seq_lens = torch.full((s,), n, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, (s + 1) * n, n, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    return lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl, d**-0.5, out=out)


CASES = {"16x512": (16, 512), "1x4096": (1, 4096), "64x128": (64, 128), "8x1024": (8, 1024), "2x8192": (2, 8192)}
if os.environ.get("AB_CASES"):
    CASES = {k: CASES[k] for k in os.environ["AB_CASES"].split(",")}
calls, rounds = 10, 9
results = {}
for cname, (s, n) in CASES.items():
    fn = case(s, n)
    graphs = {}
    ref = None
    for name, b in bindings.items():
        _lib._bindings[0] = b
        out = fn().clone()
        if ref is None:
            ref = out
        elif not os.environ.get("AB_NO_CHECK"):
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 1e-2, f"{name} differs from the first library by {err} on {cname}"
        graphs[name], _ = capture_graph(lambda fn=fn: [fn() for _ in range(calls)])
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, gr in graphs.items():
            times[name].append(cuda_time_ms(gr.replay, 2, 5) * 1e3 / calls)
    results[cname] = {name: statistics.median(t) for name, t in times.items()}
    del graphs
names = list(bindings)
print(f"{'case':<8}" + "".join(f"{n:>10}" for n in names) + "   (us per call, median of rounds; x = vs first)")
for cname, r in results.items():
    base = r[names[0]]
    ratios = " ".join(f"{r[n] / base:.3f}" for n in names[1:])
    print(f"{cname:<8}" + "".join(f"{r[n]:>10.1f}" for n in names) + "   " + ratios)
