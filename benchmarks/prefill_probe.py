"""One 512-token prefill (max_tokens=1) on the Llama-3.1-8B shape: 12 single calls, the median of 7 more,
then one call under torch.profiler: GPU kernel time by name, how long the GPU was busy against the span
of its events (a span much longer than the busy time means the host is the bottleneck), the largest gaps
between kernels and the top host ops.

    python benchmarks/prefill_probe.py [bench=1] [noprof=1] [ENGINE_ARG=VALUE ...]

bench=1 builds the engine and draws prompts exactly as `wllm bench prefill` does; other KEY=VALUE pairs
are LLM(...) engine arguments (true/false and integers converted)."""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm import LLM, SamplingParams  # noqa: E402
from wllm.bench.shapes import resolve_shape  # noqa: E402

extra = dict(a.split("=", 1) for a in sys.argv[1:])
kw = {k: (v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v) for k, v in extra.items()}
noprof = kw.pop("noprof", 0)
shape = resolve_shape("llama-3.1-8b")
if kw.pop("bench", 0):  # built and fed exactly as `wllm bench prefill` does
    from wllm.bench.wllm_runs import EngineOptions, PromptSource, build_llm
    llm = build_llm(shape, EngineOptions(engine_args=kw), 513)
    src = PromptSource(128256, 0)
else:
    llm = LLM(shape.source, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096,
              **kw)
    src = None
g = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def prompt():
    if src is not None:
        return src.take(1, 512)[0]
    return torch.randint(100, 30000, (512,), generator=g).tolist()


def one():
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt()], params)
    torch.cuda.synchronize()
    return time.perf_counter() - t


for i in range(12):
    print(f"call {i}: {1e3 * one():.2f} ms")
ts = sorted(one() for _ in range(7))
print(f"ARGS {kw}: wall ms median {1e3 * ts[3]:.2f} min {1e3 * ts[0]:.2f}")
if noprof:
    sys.exit(0)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    one()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
if ev:
    start = min(e.time_range.start for e in ev)
    end = max(e.time_range.end for e in ev)
    busy = sum(e.time_range.end - e.time_range.start for e in ev)
    print(f"GPU events {len(ev)}: busy {busy / 1e3:.2f} ms over span {(end - start) / 1e3:.2f} ms")
    agg = {}
    for e in ev:
        a = agg.setdefault(e.name[:90], [0, 0.0])
        a[0] += 1
        a[1] += (e.time_range.end - e.time_range.start) / 1e3
    for name, (n, ms) in sorted(agg.items(), key=lambda x: -x[1][1])[:14]:
        print(f"  {ms:8.3f} ms {n:5d}x {name}")
    # big gaps between consecutive kernels
    ev.sort(key=lambda e: e.time_range.start)
    gaps = []
    for a, b in zip(ev, ev[1:]):
        gaps.append(((b.time_range.start - a.time_range.end) / 1e3, a.name[:50], b.name[:50]))
    gaps.sort(key=lambda x: -x[0])
    for gms, a, b in gaps[:6]:
        print(f"  gap {gms:7.3f} ms after {a} before {b}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
