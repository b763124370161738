"""Host time per engine step of the offline throughput batch, on this machine's CPU: where do the spikes come from?

Reproduces the offline throughput workload (`wllm bench throughput`: N requests of P random prompt
tokens, O output tokens, greedy, EOS ignored, all added up front as `LLM.generate` adds them, i.e.
`final_only`) with the engine defaults a CUDA engine gets (max_num_batched_tokens 8192, max_num_seqs
256, blocks of 16, max_model_len 4096, prefix caching and async scheduling on) and the dummy
Llama-3.1-8B's tokenizer (the synthetic byte-level one over 128,256 ids). The model is a tiny llama with
that vocabulary, run through `CudaStepRunner` (the CUDA code path, on the kernels' PyTorch
references); decode steps replay stand-in graphs that cost the host nearly nothing, as a CUDA graph
replay does. What the CPU forward of eager (prefill and mixed) steps costs is measured and reported
apart ("model"): on a GPU it is device time, not host time.

Per `step()` call it records the wall time and the time in each phase, whether the step it processed
had been launched ahead, whether it launched the next step ahead, and, when
`Scheduler.schedule(in_flight)` had to wait (returned None), why (its `wait_reason`), and every cyclic GC
collection (a `gc.callbacks` hook) with its generation and whether it ran at the engine's own collection
point (`collect_garbage_if_due`, right after a launch ahead). It prints every step
whose host time (wall minus model) exceeds --threshold-ms with its phase breakdown and context, then a
summary.

    python benchmarks/host_throughput.py [--requests 256] [--prompt 512] [--output 128] [--threshold-ms 5]
                                         [--no-async-scheduling] [--all-steps]

On the GPU, what the device waits for is the host work between two launches: after a step that was
launched ahead, that is hidden behind the running step unless it exceeds that step's GPU time; after
a step whose successor is planned in turn ("in turn" below), all of the host work of the call (collect,
update, text, outputs, then schedule and launch of the next step) is GPU idle time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from benchmarks.host_overhead import TINY_LLAMA, FrozenGraphs  # noqa: E402
from wllm.engine import llm_engine as llm_engine_module  # noqa: E402
from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from wllm.engine.cuda_graphs import graph_batch_sizes  # noqa: E402
from wllm.engine.cuda_runner import CudaStepRunner  # noqa: E402
from wllm.engine.llm_engine import LLMEngine  # noqa: E402
from wllm.engine.step_plan import StepPlan  # noqa: E402
from wllm.model.loader.dummy import DUMMY_CONFIGS  # noqa: E402
from wllm.model.loader.model_loader import load_model  # noqa: E402
from wllm.model.tokenizer.synthetic import synthetic_tokenizer  # noqa: E402
from wllm.sampling_params import SamplingParams  # noqa: E402

LLAMA_8B = DUMMY_CONFIGS["llama-3.1-8b"]


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """A tiny llama with the 8B's vocabulary and EOS ids behind the CUDA step path, engine settings as on CUDA."""
    cfg = {**TINY_LLAMA, "vocab_size": LLAMA_8B["vocab_size"], "bos_token_id": LLAMA_8B["bos_token_id"],
           "eos_token_id": LLAMA_8B["eos_token_id"], "max_position_embeddings": args.max_model_len}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
        model = load_model(tmp, dtype="float32", device="cpu", load_format="dummy").model
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_gpu_blocks=args.blocks, num_cpu_blocks=0),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                                  max_model_len=args.max_model_len),
        async_scheduling=args.async_scheduling)
    tok = synthetic_tokenizer(cfg["vocab_size"])
    # The EOS set `LLMEngine.from_pretrained` gives the dummy 8B: the tokenizer's plus the config's.
    eos = sorted({*tok.eos_token_ids, *LLAMA_8B["eos_token_id"]})
    engine = LLMEngine(model, tok, config, eos_token_ids=eos)
    runner = CudaStepRunner(model, engine.worker.kv_cache, max_num_batched_tokens=args.budget,
                            max_num_seqs=args.max_num_seqs, max_model_len=engine.max_model_len, enforce_eager=True)
    runner.graphs = FrozenGraphs(graph_batch_sizes(args.max_num_seqs), runner.device)
    with torch.inference_mode():
        runner.graphs.capture(runner._prepare_padding, runner._graph_forward)
    engine.worker.runner = runner
    return engine


@dataclass
class StepRecord:
    """One `step()` call."""

    index: int
    wall_ns: int = 0
    phases: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    processed_ahead: bool = False  # the step it processed had been launched by the call before
    launched_ahead: bool = False  # it launched the next step before waiting
    refusal: str = ""  # why schedule(in_flight) returned None, if it did
    graph: bool = False  # the step it processed replayed a (stand-in) graph
    decode_seqs: int = 0  # single-token sequences of the processed step
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    admitted: int = 0  # sequences admitted by the schedule() calls of this call
    finished: int = 0  # requests that finished in this call
    outputs: int = 0
    gc: list[tuple[int, bool]] = field(default_factory=list)  # (generation, at the engine's safe point)

    @property
    def model_ns(self) -> int:
        return self.phases.get("model", 0)

    @property
    def host_ns(self) -> int:
        return self.wall_ns - self.model_ns


class StepRecorder:
    """Wraps engine methods so each call adds its time to the current step's phases."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.cur: StepRecord | None = None
        sched, runner, cuda = engine.scheduler, engine.worker, engine.worker.runner
        self._wrap(sched, "schedule", "schedule", self._after_schedule)
        self._wrap(sched, "update_from_output", "update_from_output")
        self._wrap(sched, "pop_finished_group", "pop_finished_group")
        self._wrap(sched, "_admit_waiting", None, self._after_admit)
        self._wrap(runner, "launch", "launch")
        self._wrap(runner, "collect", "collect/sync")
        self._wrap(runner, "release", "release")
        self._wrap(cuda, "_eager", "model")  # the CPU forward: device time on a GPU
        self._wrap(sched.stops, "check", "stop checks")
        self._wrap(engine, "_make_output", "_make_output")
        self._wrap(engine, "_has_live_seqs", "_has_live_seqs")
        self._gc_start = 0
        self._in_safe_point = False
        gc.callbacks.append(self._gc_event)
        # The engine's own collection point (right after a launch ahead): `step()` looks the name up here.
        fn = llm_engine_module.collect_garbage_if_due

        def safe_point() -> bool:
            self._in_safe_point = True
            try:
                return fn()
            finally:
                self._in_safe_point = False

        llm_engine_module.collect_garbage_if_due = safe_point

    def _gc_event(self, phase: str, info: dict[str, int]) -> None:
        """Cyclic GC collections inside a step, by generation (their time also counts in the phase they hit)."""
        if phase == "start":
            self._gc_start = time.perf_counter_ns()
        elif self.cur is not None:
            gen = info["generation"]
            where = "@safe-point" if self._in_safe_point else ""
            self.cur.phases[f"gc{gen}{where}"] += time.perf_counter_ns() - self._gc_start
            self.cur.gc.append((gen, bool(where)))

    def _wrap(self, obj: Any, attr: str, phase: str | None, after: Any = None) -> None:
        fn = getattr(obj, attr)
        rec = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            dt = time.perf_counter_ns() - t0
            if phase is not None and rec.cur is not None:
                rec.cur.phases[phase] += dt
            if after is not None:
                after(result, *args)
            return result

        setattr(obj, attr, timed)

    # ------------------------------------------------------------------------------ observers
    def _after_schedule(self, plan: StepPlan | None, in_flight: StepPlan | None = None) -> None:
        if plan is None and self.cur is not None:
            self.cur.refusal = self.engine.scheduler.wait_reason

    def _after_admit(self, result: Any, *args: Any) -> None:
        if self.cur is not None:
            self.cur.admitted += len(result[0])

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list[Any]:
        engine = self.engine
        cuda = engine.worker.runner
        rec = self.cur = StepRecord(len(self.steps))
        inflight = engine._inflight
        rec.processed_ahead = inflight is not None
        graphs_before = cuda.num_graph_steps
        last: list[StepPlan] = []
        update = engine.scheduler.update_from_output

        def spy(out: StepPlan, results: Any) -> Any:
            last.append(out)
            return update(out, results)

        engine.scheduler.update_from_output = spy
        t0 = time.perf_counter_ns()
        outs = engine.step()
        rec.wall_ns = time.perf_counter_ns() - t0
        engine.scheduler.update_from_output = update
        if "model" in rec.phases:  # the forward runs inside launch: count launch's host part only
            rec.phases["launch"] -= rec.phases["model"]
        rec.launched_ahead = engine._inflight is not None
        if last:
            out = last[0]
            rec.decode_seqs = sum(1 for s in out.rows if len(s.token_ids) == 1)
            rec.prefill_seqs = len(out.rows) - rec.decode_seqs
            rec.prefill_tokens = sum(len(s.token_ids) for s in out.rows if len(s.token_ids) != 1)
            # The graph the processed step replayed was launched by this call or the one before.
            rec.graph = rec.prefill_seqs == 0 and (cuda.num_graph_steps > graphs_before or rec.processed_ahead)
        rec.outputs = len(outs)
        rec.finished = sum(1 for o in outs if o.finished)
        self.steps.append(rec)
        self.cur = None
        return outs


PHASES = ("schedule", "launch", "collect/sync", "release", "update_from_output", "stop checks", "_make_output",
          "pop_finished_group", "_has_live_seqs")


def describe(rec: StepRecord) -> str:
    ms = {k: v / 1e6 for k, v in rec.phases.items() if k != "model" and not k.startswith("gc")}
    rest = rec.host_ns / 1e6 - sum(ms.values())
    parts = " ".join(f"{k}={ms[k]:.2f}" for k in PHASES if ms.get(k, 0) >= 0.05) + f" rest={rest:.2f}"
    gcs = " ".join(f"{k}={v / 1e6:.2f}" for k, v in sorted(rec.phases.items()) if k.startswith("gc"))
    if gcs:
        parts += f" | inside them, cyclic GC: {gcs}"
        if any(g == 2 for g, _ in rec.gc):
            parts += f" (gen-2 collections: {sum(1 for g, _ in rec.gc if g == 2)})"

    kind = "graph" if rec.graph else ("decode" if not rec.prefill_seqs else "mixed")
    ahead = ("processed-ahead" if rec.processed_ahead else "processed-in-turn") + \
        (" launched-ahead" if rec.launched_ahead else " NOT-launched-ahead")
    why = f" refused: {rec.refusal}" if rec.refusal else ""
    return (f"step {rec.index:4d} host {rec.host_ns / 1e6:7.2f} ms (model {rec.model_ns / 1e6:6.1f}) "
            f"[{kind}: {rec.decode_seqs} decode, {rec.prefill_seqs} prefill/{rec.prefill_tokens} tok; "
            f"admitted {rec.admitted}, finished {rec.finished}, outputs {rec.outputs}] {ahead}{why}\n"
            f"      {parts}")


def run(args: argparse.Namespace) -> list[StepRecord]:
    torch.manual_seed(0)
    engine = build_engine(args)
    recorder = StepRecorder(engine)
    gen = torch.Generator().manual_seed(args.seed)
    # `LLM.generate` (wllm bench throughput): final outputs only, prompts over the whole vocabulary.
    # profile_throughput.py's loop: an output per changed request per step, prompt ids below 1000.
    final_only = args.mode == "generate"
    vocab = LLAMA_8B["vocab_size"] if final_only else 1000
    batches = [(min(args.requests, 8), min(args.output, 4))] * args.warmup
    batches += [(args.requests, args.output)] * args.batches
    steps: list[StepRecord] = []
    for b, (count, out_len) in enumerate(batches):
        prompts = torch.randint(0, vocab, (count, args.prompt), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        # Every request added up front, as `LLM.generate` adds them.
        for i, p in enumerate(prompts):
            engine.add_request(f"b{b}-{i}", p, params, final_only=final_only)
        recorder.steps = []
        finished: dict[str, Any] = {}
        t0 = time.perf_counter()
        while len(finished) < count:
            for out in recorder.step():
                if out.finished:
                    finished[out.request_id] = out
        wall = time.perf_counter() - t0
        bad = [o.request_id for o in finished.values() if len(o.outputs[0].token_ids) != out_len]
        if bad:
            raise SystemExit(f"requests {bad[:5]} did not produce {out_len} tokens")
        print(f"batch {b}: {count} requests x {args.prompt} prompt + {out_len} output tokens ({args.mode}): "
              f"{len(recorder.steps)} step() calls, {wall:.2f} s wall on this CPU (async scheduling "
              f"{'on' if args.async_scheduling else 'off'})")
        steps = recorder.steps
    return steps  # the last batch's


def summarize(steps: list[StepRecord], threshold_ms: float, all_steps: bool) -> None:
    thr = threshold_ms * 1e6
    print(f"\nsteps with host time over {threshold_ms} ms (host = wall - CPU model time; phase times in ms):")
    for rec in steps:
        if all_steps or rec.host_ns > thr:
            print(describe(rec))
    host = [r.host_ns / 1e6 for r in steps]
    graph = [r.host_ns / 1e6 for r in steps if r.graph]
    in_turn = [r for r in steps if not r.launched_ahead]
    refusals: dict[str, int] = defaultdict(int)
    for r in steps:
        if r.refusal:
            refusals[r.refusal] += 1
    totals: dict[str, float] = defaultdict(float)
    for r in steps:
        for k, v in r.phases.items():
            totals[k] += v / 1e6
    print("\nsummary")
    print(f"  step() calls {len(steps)}; launched the next step ahead {sum(r.launched_ahead for r in steps)}; "
          f"not {len(in_turn)}")
    print(f"  host ms per step: median {statistics.median(host):.2f}, max {max(host):.2f}, "
          f"total {sum(host):.1f}; graph-decode steps median {statistics.median(graph) if graph else 0:.2f}")
    print(f"  steps over {threshold_ms} ms: {sum(h > threshold_ms for h in host)} "
          f"(their host time {sum(h for h in host if h > threshold_ms):.1f} ms)")
    print(f"  host ms of calls that did not launch ahead (GPU idle through all of it on a GPU): "
          f"{sum(r.host_ns for r in in_turn) / 1e6:.1f} over {len(in_turn)} calls")
    print(f"  lookahead refusals: {dict(refusals) or 'none'}")
    for gen in range(3):
        n = sum(1 for r in steps for g, safe in r.gc if g == gen and not safe)
        n_safe = sum(1 for r in steps for g, safe in r.gc if g == gen and safe)
        ms = totals.get(f"gc{gen}", 0.0)
        print(f"  cyclic GC generation {gen}: {n} collections anywhere in the step, {ms:.1f} ms; "
              f"{n_safe} at the engine's safe point (after a launch ahead), "
              f"{totals.get(f'gc{gen}@safe-point', 0.0):.1f} ms")
    print("  total ms per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda x: -x[1])
                                             if not k.startswith("gc")))


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload and engine options this script and benchmarks/gc_walk.py share."""
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (the CUDA default)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=32768, help="KV blocks (an 8B engine on an H200 has ~30k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="small warm-up batches first, as the benchmarks run")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--mode", choices=("generate", "profile"), default="generate",
                    help="generate: requests as LLM.generate adds them (final_only); profile: as "
                         "benchmarks/profile_throughput.py adds them (outputs every step, prompt ids < 1000)")
    ap.add_argument("--batches", type=int, default=1, help="full batches; the last one is reported")
    ap.add_argument("--threshold-ms", type=float, default=5.0)
    ap.add_argument("--all-steps", action="store_true", help="print every step, not only the slow ones")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    summarize(run(args), args.threshold_ms, args.all_steps)


if __name__ == "__main__":
    main()
