"""Where does a batch-1 decode step's time go on the GPU? A kernel trace of CUDA-graph decode.

Runs wLLM on random weights in a real shape, decodes a warm batch-1 request, then traces
`--steps` more decode steps with torch.profiler (CUPTI sees the kernels inside graph replays) and
prints: wall time per step, GPU kernel time per step (sum of kernel durations), kernels per step,
the idle share of the GPU timeline, and the top kernels by total time.

    python benchmarks/profile_decode.py --shape qwen2.5-0.5b --steps 32
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from wllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_throughput import print_gaps  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--trace", type=int, default=256, help="new tokens of the per-step trace (0: none)")
    args = parser.parse_args()

    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.5)
    prompt = [[int(t) for t in torch.randint(0, 1000, (128,))]]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt, greedy)  # warm-up: graphs, allocator, caches
    engine = llm.engine
    engine.add_request("profiled", prompt[0], SamplingParams(temperature=0, max_tokens=args.steps + 8,
                                                             ignore_eos=True))
    for _ in range(4):  # prefill + a few decode steps outside the trace
        engine.step()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        _sync()
        wall = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()

    def dur(e) -> float:  # noqa: ANN001 - profiler event
        return getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and dur(e) > 0]
    total_us = sum(dur(e) for e in kernels)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(dur(e))
    step_ms = wall / args.steps * 1e3
    gpu_ms = total_us / args.steps / 1e3
    print(f"{args.shape}: {args.steps} decode steps at batch 1 (CUDA graphs)")
    print(f"wall per step        {step_ms:8.3f} ms   ({1e3 / step_ms:.0f} tok/s, profiler on)")
    print(f"kernel time per step {gpu_ms:8.3f} ms   ({len(kernels) / args.steps:.0f} kernels per step)")
    print(f"GPU idle share       {100 * (1 - gpu_ms / step_ms):7.1f} %")
    print(f"\n{'kernel':70} {'calls/step':>10} {'us/step':>9}")
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for name, times in ranked:
        print(f"{name[:70]:70} {len(times) / args.steps:10.1f} {sum(times) / args.steps:9.1f}")
    # Host side: CUDA runtime calls the engine loop makes (graph launch, copies, the sync).
    runtime: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
            runtime[e.name].append(e.cpu_time_total)
    print(f"\n{'CUDA runtime call (host)':70} {'calls/step':>10} {'us/step':>9}")
    for name, times in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"{name[:70]:70} {len(times) / args.steps:10.1f} {sum(times) / args.steps:9.1f}")
    print_gaps(prof, (1, 2, 5, 10, 50), per=args.steps)
    phases(engine, prompt[0], args.steps)
    step_trace(engine, prompt[0], args.trace)


def phases(engine, prompt: list[int], steps: int) -> None:  # noqa: ANN001 - LLMEngine
    """Host time per decode step by phase, profiler off: the engine's methods wrapped in timers,
    the stream sync timed separately (the GPU runs while the host waits there)."""
    import functools

    totals: dict[str, float] = defaultdict(float)

    def timed(obj, name: str, label: str) -> None:  # noqa: ANN001
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.worker, "launch", "launch")
    timed(engine.worker, "collect", "collect (incl. sync)")
    timed(engine.scheduler, "update_from_output", "update_from_output")
    timed(engine.scheduler.stops, "check", "detokenize + stop strings")
    timed(engine, "_make_output", "make outputs")
    sync_orig = torch.cuda.Stream.synchronize

    def sync(self):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return sync_orig(self)
        finally:
            totals["  of which: waiting in stream sync"] += time.perf_counter() - t0
    torch.cuda.Stream.synchronize = sync
    engine.add_request("phases", prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    totals.clear()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    torch.cuda.Stream.synchronize = sync_orig
    while engine.has_unfinished():
        engine.step()
    print(f"\nhost phases per decode step (profiler off): wall {wall / steps * 1e6:.0f} us")
    for label, t in totals.items():
        print(f"  {label:45} {t / steps * 1e6:8.1f} us")


def step_trace(engine, prompt: list[int], new_tokens: int) -> None:  # noqa: ANN001 - LLMEngine
    """Wall time of every engine step of one request as `wllm bench latency` runs it (profiler off): by
    context bucket, the slowest steps (a step that cannot run ahead shows up as an outlier), and how
    many steps ran ahead."""
    if new_tokens <= 0:
        return
    engine.add_request("trace", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    ahead0, steps0 = engine.num_lookahead_steps, engine.num_steps
    times: list[float] = []
    _sync()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    _sync()
    ahead, steps = engine.num_lookahead_steps - ahead0, engine.num_steps - steps0
    print(f"\nstep trace: {len(prompt)}-token prompt, {new_tokens} new tokens, {len(times)} step() calls, "
          f"{steps} steps launched ({ahead} ahead), total {sum(times) * 1e3:.1f} ms")
    bucket = 32
    for i in range(0, len(times), bucket):
        part = sorted(times[i:i + bucket])
        print(f"  steps {i:4d}-{i + len(part) - 1:4d}: median {part[len(part) // 2] * 1e3:7.3f} ms, "
              f"max {part[-1] * 1e3:7.3f} ms, sum {sum(part) * 1e3:8.2f} ms")
    slow = sorted(range(len(times)), key=lambda i: -times[i])[:8]
    print("  slowest steps (index: ms): " + ", ".join(f"{i}: {times[i] * 1e3:.2f}" for i in sorted(slow)))


if __name__ == "__main__":
    main()
