"""Mixed steps whose decode rows have long contexts, and mixed steps of many sequences: the CUDA graph
against the eager step.

A captured mixed step sends its decode rows to the decode kernel (split-KV for long contexts) and its prompt
rows to the prefill kernel, as the eager step does, without the eager step's host work (~0.25 ms of
Python and launches per layer). For each decode context C, D requests are prefilled to C tokens and left
decoding (D = the largest of --decode first, then fewer by aborting; pairs with D x C over --max-cached
skipped); then, per round, one request of --prompt tokens and max_tokens=1 is added and the engine stepped
until it finishes (one mixed step of D decode rows and the prompt, and whatever decode step the lookahead
queued). Rounds alternate between the graph and eager (the prefill graphs' lookup patched to find none);
the median wall per round of each is printed, with how many mixed steps replayed a graph.

    python benchmarks/mixed_step_probe.py [--shape llama-3.1-8b] [--contexts 1024,4096,16384]
        [--decode 63,15,7,1] [--prompt 64] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from wllm import LLM, SamplingParams  # noqa: E402
from wllm.bench.shapes import resolve_shape  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--contexts", type=ints, default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--decode", type=ints, default=[63, 15, 7, 1], help="decode rows, largest first")
    ap.add_argument("--max-cached", type=int, default=1 << 18, help="skip D x C above this many tokens")
    ap.add_argument("--prompt", type=int, default=64, help="tokens of the prompt that makes the step mixed")
    ap.add_argument("--rounds", type=int, default=9, help="rounds per mode (graph, eager), alternating")
    args = ap.parse_args()

    shape = resolve_shape(args.shape)
    top = max(args.contexts)
    llm = LLM(shape.source, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=0.7,
              max_model_len=top + 1024, max_num_seqs=max(args.decode) + 1)
    engine = llm.engine
    runner = engine.worker.runner
    if not engine.worker.use_cuda_kernels:
        sys.exit("mixed_step_probe: needs the CUDA kernel path (a GPU and the wllm kernels)")
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 30000, (n,), generator=g).tolist()

    keep = SamplingParams(temperature=0.0, max_tokens=top, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rid = iter(range(1 << 30))
    rows = []
    print(f"shape {args.shape}, prompt {args.prompt} tokens; ms per round (a mixed step + the lookahead's decode step)")
    print(f"{'context':>8} {'decode':>6} {'graph ms':>9} {'eager ms':>9} {'graph/eager':>11} {'graphs':>7}")
    for context in args.contexts:
        counts = [d for d in args.decode if d * context <= args.max_cached]
        if not counts:
            continue
        live = [f"long{next(rid)}" for _ in range(counts[0])]
        for name in live:
            engine.add_request(name, ids(context - 1), keep)
        while any(s.num_computed_tokens < context - 1 for s in _seqs(engine, live)):
            engine.step()
        for _ in range(3):  # every long request decoding, steady state
            engine.step()
        for d in counts:
            for name in live[d:]:
                engine.abort(name)
            live = live[:d]
            times: dict[str, list[float]] = {"graph": [], "eager": []}
            graphs0 = runner.num_prefill_graph_steps
            for r in range(2 * args.rounds + 2):
                mode = "graph" if r % 2 == 0 else "eager"
                if mode == "eager":  # no captured shape holds the step
                    runner.prefill_graphs.padded_shape = lambda tokens, seqs, mixed: None
                else:
                    runner.prefill_graphs.__dict__.pop("padded_shape", None)
                name = f"short{next(rid)}"
                sync()
                t = time.perf_counter()
                engine.add_request(name, ids(args.prompt), one)
                while not any(o.request_id == name and o.finished for o in engine.step()):
                    pass
                sync()
                if r >= 2:  # the first pair warms up
                    times[mode].append(1e3 * (time.perf_counter() - t))
            runner.prefill_graphs.__dict__.pop("padded_shape", None)
            replayed = runner.num_prefill_graph_steps - graphs0
            gm, em = statistics.median(times["graph"]), statistics.median(times["eager"])
            rows.append((context, d, gm, em))
            print(f"{context:>8} {d:>6} {gm:>9.2f} {em:>9.2f} {gm / em:>11.3f} {replayed:>7}", flush=True)
        for name in live:
            engine.abort(name)
    losses = [(c, d) for c, d, gm, em in rows if gm > em]
    print(f"graph slower than eager at (context, decode rows): {losses or 'none'}")


def _seqs(engine, names: list[str]) -> list:
    return [seq for name in names for seq in engine.scheduler.groups[name].seqs]


if __name__ == "__main__":
    main()
