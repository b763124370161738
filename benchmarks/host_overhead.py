"""Host time per decode step of the engine loop, split by phase, on this machine's CPU.

A tiny llama (2 layers, hidden 64, random weights) keeps model time negligible, so what is left is
the Python engine loop the GPU waits on: scheduling, input preparation, the forward launch, the
device->host sync, output processing, detokenization and stop checks. The step runs through
`CudaStepRunner` (the CUDA code path, here on the kernels' PyTorch references); with `--graphs`
(the default) decode steps "replay" a stand-in graph that returns the outputs captured once, as a
CUDA graph replay costs the host next to nothing, so the forward launch phase is near zero.

    python benchmarks/host_overhead.py [--batch 1 64] [--steps 200] [--repeat 3] [--eager] [--profile N]
                                       [--no-async-scheduling] [--skip N] [--logprobs K]

Prints microseconds per decode step per phase (prefill steps are excluded) and, with --profile,
the top N functions of a cProfile run of the same decode steps. With async scheduling (the
default) the engine plans and launches step N+1 before it waits for step N ("schedule" includes
that planning); on the CPU every phase still runs in turn, but on a GPU everything except the wait
overlaps the device's work on the previous step, so the total here is the host's work per step, and
the GPU stays busy as long as it is below the GPU's time per step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from wllm.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402
from wllm.engine.cuda_runner import CudaStepRunner  # noqa: E402
from wllm.engine.llm_engine import LLMEngine  # noqa: E402
from wllm.model.loader.model_loader import load_model  # noqa: E402
from wllm.model.tokenizer.synthetic import synthetic_tokenizer  # noqa: E402
from wllm.sampling_params import SamplingParams  # noqa: E402

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


class FrozenGraphs(DecodeGraphs):
    """CPU stand-in for CUDA graphs: capture runs the forward once per size; replay returns the
    captured output tensors without recomputing (as a replay writes into the same static outputs)."""

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], Any]) -> None:
        for b in reversed(self.sizes):
            prepare(b)
            self._graphs[b] = (None, forward(b))

    def replay(self, size: int) -> Any:
        return self._graphs[size][1]


def build_engine(batch: int, graphs: bool, async_scheduling: bool = True) -> LLMEngine:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
        model = load_model(tmp, dtype="float32", device="cpu", load_format="dummy").model
    config = EngineConfig(cache=CacheConfig(block_size=16, num_gpu_blocks=4096, num_cpu_blocks=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max(batch, 8)),
                          async_scheduling=async_scheduling)
    engine = LLMEngine(model, synthetic_tokenizer(TINY_LLAMA["vocab_size"]), config)
    runner = CudaStepRunner(model, engine.worker.kv_cache, max_num_batched_tokens=2048,
                            max_num_seqs=max(batch, 8), max_model_len=engine.max_model_len, enforce_eager=True)
    if graphs:
        runner.graphs = FrozenGraphs(graph_batch_sizes(max(batch, 8)), runner.device)
        with torch.inference_mode():
            runner.graphs.capture(runner._prepare_padding, runner._graph_forward)
    engine.worker.runner = runner
    return engine


class PhaseTimer:
    """Wraps methods so each call adds its wall time (ns) to a named phase while `active`."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.active = False

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[phase] += time.perf_counter_ns() - t0

        setattr(obj, attr, timed)


def run(batch: int, steps: int, graphs: bool, profile: int, async_scheduling: bool = True,
        final_only: bool = False, skip: int = 0, logprobs: int | None = None) -> dict[str, float]:
    torch.manual_seed(0)
    engine = build_engine(batch, graphs, async_scheduling)
    cuda = engine.worker.runner
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(cuda.inputs, "fill", "prepare inputs")
    timer.wrap(cuda.sampling, "pack", "prepare inputs")
    timer.wrap(cuda.graphs, "replay", "forward launch")
    timer.wrap(cuda, "_eager", "forward launch")
    timer.wrap(cuda, "_results", "process outputs (runner)")
    timer.wrap(engine.worker, "launch", "_execute")
    timer.wrap(engine.worker, "collect", "_execute")
    timer.wrap(engine.scheduler, "update_from_output", "process outputs")
    timer.wrap(engine.scheduler.stops, "check", "detokenize/stop")
    timer.wrap(engine, "_make_output", "detokenize/stop")
    timer.wrap(engine, "step", "_step")
    params = SamplingParams(temperature=0.0, max_tokens=skip + 2 * steps + 50, ignore_eos=True, logprobs=logprobs)
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(3, 3 + 32)), params, final_only=final_only)
    for _ in range(3 + skip):  # the prefill, a couple of warm-up decode steps, and --skip more
        engine.step()
    decode_steps = steps
    timer.active = True
    for _ in range(decode_steps):
        engine.step()
    timer.active = False
    ns = dict(timer.ns)
    execute_ns = ns.pop("_execute")
    step_ns = ns.pop("_step")
    inside = ("prepare inputs", "forward launch", "process outputs (runner)")
    # The rest of launch + collect: sampling rows and step lists, the D2H copies and the sync.
    ns["sync + rest of execute"] = execute_ns - sum(ns.get(k, 0) for k in inside)
    ns["engine loop rest"] = step_ns - sum(ns.values())
    us = {k: v / decode_steps / 1000 for k, v in ns.items()}
    us["TOTAL step"] = step_ns / decode_steps / 1000
    assert engine.worker.runner.num_graph_steps >= (decode_steps if graphs else 0)
    us["steps run ahead (%)"] = 100.0 * engine.num_lookahead_steps / engine.num_steps
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(decode_steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return us


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eager", action="store_true", help="no graph stand-in: every step runs the forward")
    ap.add_argument("--profile", type=int, default=0, help="print the top N cProfile functions")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="finish each step before launching the next (no lookahead)")
    ap.add_argument("--final-only", action="store_true",
                    help="requests as LLM.generate adds them: outputs only when finished, text decoded at the end")
    ap.add_argument("--skip", type=int, default=0,
                    help="decode steps run before timing starts (outputs that many tokens long when it does)")
    ap.add_argument("--logprobs", type=int, default=None, help="every request asks for this many top logprobs")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per batch size; the run with the lowest total is shown (shared machines are noisy)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for batch in args.batch:
        runs = [run(batch, args.steps, not args.eager, args.profile, args.async_scheduling, args.final_only,
                    args.skip, args.logprobs)
                for _ in range(max(args.repeat, 1))]
        us = min(runs, key=lambda r: r["TOTAL step"])
        print(f"batch {batch}: host us per decode step ({args.steps} steps, best of {len(runs)})")
        for k, v in us.items():
            print(f"  {k:24s} {v:9.1f}")


if __name__ == "__main__":
    main()
