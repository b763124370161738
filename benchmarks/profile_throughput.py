"""Where does the offline-throughput run's time go? Steps by kind, then kernels by kind.

Runs the issue's throughput workload (N requests of P random prompt tokens, O output tokens, EOS
ignored, greedy) on random weights in a real shape through `LLMEngine.step()`, and prints:
1. wall time split by step kind (steps with prefill tokens vs pure decode steps), steps, tokens
   and batch sizes of each kind, host time per step outside the stream sync;
2. a second, profiled run: GPU kernel time by kernel family (GEMM, attention, norms, ...), and the
   share of the wall time the GPU was idle.

    python benchmarks/profile_throughput.py --shape llama-3.1-8b [--requests 256] [--prompt 512] [--output 128]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from wllm import LLM, SamplingParams
from wllm.bench.shapes import resolve_shape
from wllm.entrypoints.bench_cli import parse_engine_arg

FAMILIES = (  # first match wins
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "splitKreduce", "gemv")),
    ("prefill attention", ("prefill",)),
    ("decode attention", ("paged_decode", "merge_splits")),
    ("norm", ("rms_norm",)),
    ("rotary + kv write", ("rotary", "reshape_and_cache", "rope")),
    ("activation", ("act_and_mul",)),
    ("sampling", ("sample", "softmax", "argmax")),
    ("copies", ("copy", "Memcpy", "memcpy", "gather", "index")),
)


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


MARKS = ("step() #", "gc gen")  # record_function ranges of this script; kineto also puts them on the GPU row


def device_events(prof: profile) -> list:
    """The profile's kernels and copies (CUDA device events), without this script's range annotations."""
    return [e for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(MARKS)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_workload(llm: LLM, prompts: list[list[int]], output: int, record: bool,
                 mark: bool = False) -> tuple[float, dict]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    kinds: dict[str, list[float]] = defaultdict(list)
    tokens: dict[str, int] = defaultdict(int)
    seqs: dict[str, int] = defaultdict(int)
    sync_wait = [0.0]
    orig = torch.cuda.Stream.synchronize

    def timed_sync(self):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return orig(self)
        finally:
            sync_wait[0] += time.perf_counter() - t0

    if record:
        torch.cuda.Stream.synchronize = timed_sync
    # A step() call processes one step, planned by schedule() in that call or by schedule(in_flight) in
    # the call before (it ran ahead): its kind is read from the step update_from_output applies.
    sched = engine.scheduler
    update = sched.update_from_output
    last: list = [None]

    def spy(out, results):  # noqa: ANN001, ANN202
        last[0] = out
        return update(out, results)

    sched.update_from_output = spy
    collections: list[tuple[int, float, int]] = []  # (generation, ms, step index) of each cyclic GC
    gc_start = [0.0]

    gc_range: list = [None]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
            if mark and info["generation"] == 2:  # a named range, for the host view of the GPU gaps
                gc_range[0] = record_function("gc gen 2")
                gc_range[0].__enter__()
        else:
            collections.append((info["generation"], 1e3 * (time.perf_counter() - gc_start[0]),
                                sum(len(v) for v in kinds.values())))
            if gc_range[0] is not None:
                gc_range[0].__exit__(None, None, None)
                gc_range[0] = None

    if record or mark:
        gc.callbacks.append(on_gc)
    _sync()
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            last[0] = None
            t0 = time.perf_counter()
            if mark:  # a named range per step() call, for the host view of the GPU gaps
                with record_function(f"step() #{sum(len(v) for v in kinds.values())}"):
                    engine.step()
            else:
                engine.step()
            dt = time.perf_counter() - t0
            out = last[0]
            if out is None or not out.rows:
                continue
            kind = "decode" if all(len(s.token_ids) == 1 for s in out.rows) else "prefill/mixed"
            kinds[kind].append(dt)
            tokens[kind] += out.num_batched_tokens
            seqs[kind] += len(out.rows)
        _sync()
    finally:
        torch.cuda.Stream.synchronize = orig
        del sched.update_from_output  # the instance attribute shadowed the method
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - start
    return wall, {"kinds": kinds, "tokens": tokens, "seqs": seqs, "sync_wait": sync_wait[0], "gc": collections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-gc", action="store_true", help="cyclic GC off during the two timed batches")
    parser.add_argument("--engine-arg", type=parse_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="another LLM(...) engine argument, e.g. max_num_batched_tokens=16384 (repeatable)")
    args = parser.parse_args()

    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.6,
              **dict(args.engine_arg))
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(0, 1000, (n, args.prompt), generator=gen).tolist()

    run_workload(llm, prompts(32), 8, record=False)  # warm-up
    if args.no_gc:
        gc.disable()
    wall, info = run_workload(llm, prompts(args.requests), args.output, record=True)
    print(f"{args.shape}: {args.requests} x ({args.prompt} + {args.output}), greedy, EOS ignored")
    print(f"wall {wall:.3f} s; host waited in stream syncs {info['sync_wait']:.3f} s "
          f"(host busy {wall - info['sync_wait']:.3f} s)")
    print(f"{'step kind':15} {'steps':>6} {'total s':>8} {'ms/step':>8} {'tokens':>8} {'mean seqs':>9}")
    for kind, times in info["kinds"].items():
        n = len(times)
        print(f"{kind:15} {n:6d} {sum(times):8.3f} {1e3 * sum(times) / n:8.2f} {info['tokens'][kind]:8d} "
              f"{info['seqs'][kind] / n:9.1f}")
    steps = [(dt, kind, i) for kind, times in info["kinds"].items() for i, dt in enumerate(times)]
    for generation in range(3):
        ms = [c[1] for c in info["gc"] if c[0] == generation]
        at = ", ".join(f"{c[1]:.1f} @ {c[2]}" for c in info["gc"] if c[0] == generation)
        print(f"cyclic GC generation {generation}: {len(ms)} collections, {sum(ms):.1f} ms"
              + (f" (ms @ step: {at})" if generation == 2 else ""))
    print("slowest steps (ms, kind, index within its kind): "
          + ", ".join(f"{dt * 1e3:.1f} {kind} #{i}" for dt, kind, i in sorted(steps, reverse=True)[:8]))
    if args.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_workload(llm, prompts(args.requests), args.output, record=False, mark=True)
        pwall = time.perf_counter() - t0
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in device_events(prof):
        d = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
        by_family[family(e.name)] += d
        by_name[e.name] += d
    busy = sum(by_family.values()) / 1e6
    idle = 100 * (1 - busy / pwall)
    print(f"\nprofiled run: wall {pwall:.3f} s, GPU kernel time {busy:.3f} s, GPU idle {idle:.1f} %")
    for fam, us in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {fam:20} {us / 1e6:8.3f} s")
    print("top kernels:")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name[:80]:80} {us / 1e6:8.3f} s")
    totals = print_by_step_kind(prof)
    print_gemm_efficiency(args.shape, info, totals)
    print_gaps(prof)
    print_host_in_gaps(prof)


def print_gemm_efficiency(shape: str, info: dict, totals: dict[str, dict[str, float]]) -> None:
    """GEMM time by step kind against the GEMMs' own FLOPs: 2 x (decoder-layer weights) per token the
    step ran, plus 2 x (lm_head weights) per sequence it sampled for, at the measured bf16 peak. (The
    throughput floor of `wllm bench` counts 2 x all parameters per token, the embedding and an lm_head
    row for every prompt token included, as the issue's figures do: ~13% more than the GEMMs run.)"""
    from gemm_shapes import projections

    from wllm.bench.floors import H200

    projs = projections(shape)
    layers = resolve_shape(shape).hf_config["num_hidden_layers"]
    layer_params = layers * sum(n * k for name, (n, k) in projs.items() if name != "lm_head")
    head_params = projs["lm_head"][0] * projs["lm_head"][1]
    print(f"GEMM efficiency by step kind (FLOPs of the tokens and sampled rows of the measured run, "
          f"against {H200.flops / 1e12:.0f} TFLOP/s):")
    for kind, fam in totals.items():
        secs = fam.get("gemm", 0.0) / 1e6
        flops = 2.0 * layer_params * info["tokens"][kind] + 2.0 * head_params * info["seqs"][kind]
        if secs > 0:
            print(f"  {kind:15} {flops / 1e12:9.1f} TFLOP in {secs:.3f} s: {flops / secs / 1e12:6.1f} TFLOP/s, "
                  f"{100 * flops / secs / H200.flops:5.1f}% (compute floor {flops / H200.flops:.3f} s)")


def print_host_in_gaps(prof: profile, top: int = 6, min_us: float = 500.0) -> None:
    """What the host was doing while the GPU idled: for each of the largest gaps between kernels, the
    step() call and the host calls (CUDA runtime calls, torch ops) over `min_us` that overlap it; then
    the longest CUDA runtime calls of the run."""
    t_first, gaps = gpu_gaps(prof)
    if not gaps:
        return
    host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type != torch.autograd.DeviceType.CUDA and e.time_range.end - e.time_range.start >= min_us]
    print(f"host calls over {min_us / 1e3:.1f} ms overlapping the largest GPU gaps (ms from the first kernel):")
    for g, a, b, _, _ in sorted(gaps, reverse=True)[:top]:
        print(f"  gap {g / 1e3:.1f} ms at {(a - t_first) / 1e3:.1f}:")
        for ha, hb, name in sorted(h for h in host if h[0] < b and h[1] > a):
            print(f"    {(ha - t_first) / 1e3:9.1f} +{(hb - ha) / 1e3:7.1f}  {name[:70]}")
    runtime = sorted(((hb - ha, name, ha) for ha, hb, name in host if name.startswith("cuda")), reverse=True)
    print("longest CUDA runtime calls (ms, at ms): "
          + ", ".join(f"{name} {d / 1e3:.1f} @ {(ha - t_first) / 1e3:.0f}" for d, name, ha in runtime[:10]))


def print_by_step_kind(prof: profile) -> dict[str, dict[str, float]]:
    """GPU kernel time by family, split between steps with prefill tokens and pure decode steps.

    Each step's kernels end with its sampler (`sample_kernel`); a step that ran the prefill attention
    kernel had prefill tokens. The GEMM kernels' names (cuBLAS tile configurations) are listed per kind,
    since decode (M = batch) and prefill (M = step tokens) GEMMs run different ones."""
    spans = sorted((e.time_range.start, e.name, getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0))
                   for e in device_events(prof))
    totals: dict[str, dict[str, float]] = {"prefill/mixed": defaultdict(float), "decode": defaultdict(float)}
    gemms: dict[str, dict[str, list[float]]] = {"prefill/mixed": defaultdict(list), "decode": defaultdict(list)}
    steps = {"prefill/mixed": 0, "decode": 0}
    seg: list[tuple[str, float]] = []
    for _, name, us in spans:
        seg.append((name, us))
        if "sample_kernel" not in name:
            continue
        kind = "prefill/mixed" if any(family(n) == "prefill attention" for n, _ in seg) else "decode"
        steps[kind] += 1
        for n, t in seg:
            totals[kind][family(n)] += t
            if family(n) == "gemm":
                gemms[kind][n].append(t)
        seg = []
    print("GPU time by step kind (s; steps split at each sampler launch):")
    fams = sorted({f for k in totals.values() for f in k}, key=lambda f: -sum(t[f] for t in totals.values()))
    print(f"  {'family':20} " + " ".join(f"{k:>14}" for k in totals))
    for f in fams:
        print(f"  {f:20} " + " ".join(f"{totals[k][f] / 1e6:14.3f}" for k in totals))
    print(f"  {'steps':20} " + " ".join(f"{steps[k]:14d}" for k in totals))
    for kind, by in gemms.items():
        print(f"GEMM kernels in {kind} steps (calls, total s, mean us):")
        for n, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"  {n[:90]:90} {len(ts):6d} {sum(ts) / 1e6:8.3f} {sum(ts) / len(ts):9.1f}")
    return totals


def gpu_gaps(prof: profile) -> tuple[float, list[tuple[float, float, float, str, str]]]:
    """The first kernel's start and the GPU's idle intervals between kernels (the union of their
    intervals, PDL overlap included): (length, start, end, kernel before, kernel after), in us."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in device_events(prof))
    if not spans:
        return 0.0, []
    gaps = []
    end, last = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, end, start, last, name))
        if stop > end:
            end, last = stop, name
    return spans[0][0], gaps


def print_gaps(prof: profile, edges_us: tuple[float, ...] = (10, 100, 1000), per: int = 1) -> None:
    """Where the GPU idles: gaps between kernels (union of their intervals, PDL overlap included) by
    size (bucket edges in us), and the largest ones with the kernels on either side (host work shows
    up as the gaps). Totals are divided by `per` (steps, for per-step figures)."""
    _, gaps = gpu_gaps(prof)
    if not gaps:
        return
    bounds = (0, *edges_us, float("inf"))
    unit = "s" if per == 1 else "us per step"
    print(f"GPU idle between kernels (us buckets: count, total {unit}):")
    for lo, hi in zip(bounds, bounds[1:]):
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        total = sum(sel) / 1e6 if per == 1 else sum(sel) / per
        print(f"  {lo:>5}-{hi:<6} {len(sel) / per:9.1f} {total:10.3f}")
    print("largest gaps (us, kernel before -> kernel after):")
    for g, _, _, before, after in sorted(gaps, key=lambda t: -t[0])[:10]:
        print(f"  {g:9.0f}  {before[:50]} -> {after[:50]}")


if __name__ == "__main__":
    main()
