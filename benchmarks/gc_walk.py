"""What a full (generation-2) GC collection walks during the offline batch, by owner, and what it costs.

After `gc.freeze()` at engine start, a full collection still traverses every GC-tracked container that
is alive, and `tp_traverse` visits every reference it holds: a list of 640 small ints costs 640 visits
(twice: once to subtract internal references, once to mark what is reachable), however small the ints.
This script runs the offline throughput workload of `benchmarks/host_throughput.py` (same engine, same
defaults: N requests of P random prompt tokens, O output tokens, greedy, EOS ignored, all added up
front with `final_only`, as `LLM.generate` adds them) and, at two moments of the last batch, walks
`gc.get_objects()` (the collector's generations; frozen objects are not in them):

- "admitted": the first step after which every request is running with its whole prompt computed;
- "peak": the step before the first request finishes (its sequence holds O - 1 outputs), where every
  request is alive with the most output ids it will have together.

With the default two full batches, the walk also shows what the first batch left for the collector
(unattributed: it is no longer reachable from the engine).

Each tracked object is attributed to an owner in the engine (the request's token-id lists, block
tables, prefix-cache hashes, the in-flight step's staging, ...) or to the caller (the prompt lists the
caller passed in), else to its type. For each owner it prints objects, references walked
(`len(gc.get_referents(o))`, which is what traversal visits) and, for lists, items. Then it times
`gc.collect(2)` at that moment (first call, then the best of two more; the first one also untracks
tuples of untracked items, which the running engine's own collections have mostly done already).

    python benchmarks/gc_walk.py [--requests 256] [--prompt 512] [--output 128]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

from benchmarks.host_throughput import LLAMA_8B, add_workload_args, build_engine  # noqa: E402
from wllm.engine.llm_engine import LLMEngine  # noqa: E402
from wllm.sampling_params import SamplingParams  # noqa: E402


def engine_owners(engine: LLMEngine, caller: list[Any]) -> dict[int, str]:
    """id(object) -> owner label for the engine's per-request state and the caller's prompts."""
    owners: dict[int, str] = {}

    def mark(obj: Any, label: str) -> None:
        if obj is not None and gc.is_tracked(obj):
            owners.setdefault(id(obj), label)

    mark(caller, "caller: list of prompts")
    for p in caller:
        mark(p, "caller: prompt lists")
    sched = engine.scheduler
    for group in sched.groups.values():
        mark(group.prompt_token_ids, "RequestGroup.prompt_token_ids")
        mark(group, "RequestGroup objects")
        mark(group.__dict__, "RequestGroup objects")
        mark(group.seqs, "RequestGroup.seqs")
        for seq in group.seqs:
            for name in ("prompt_token_ids", "output_token_ids", "block_hashes", "blocks",
                         "_block_ids", "swapped_cpu_blocks", "logprobs"):
                mark(getattr(seq, name, None), f"Sequence.{name}")
            mark(seq, "Sequence objects")
            mark(getattr(seq, "__dict__", None), "Sequence objects")
            state = seq.text_state
            if state is not None:
                for obj in (state, state.__dict__, state._detok, state._detok.__dict__, state._detok._text_parts):
                    mark(obj, "TextState (detokenizer)")
                mark(state._deferred, "TextState._deferred (final_only output ids)")
                mark(state._detok._ids, "IncrementalDetokenizer._ids")
            row = seq.sampling_row
            if row is not None:
                mark(row, "SamplingRow objects")
    mark(sched.eos_token_ids, "scheduler: other")
    for obj in (sched.running, sched.seqs, sched.groups):
        mark(obj, "scheduler: running/waiting/seqs/groups")
    pool = sched.kv.pool
    mark(pool.blocks, "BlockPool.blocks (the list)")
    mark(pool.cached, "BlockPool.cached (hash -> block)")
    for block in pool.blocks:
        mark(block, "KVBlock objects")
        mark(block.token_ids, "KVBlock.token_ids (tuples)")
    inflight = engine._inflight
    if inflight is not None:
        out, handle = inflight
        mark(out, "in-flight step (StepPlan, PendingStep)")
        mark(out.rows, "in-flight step (StepPlan, PendingStep)")
        mark(handle, "in-flight step (StepPlan, PendingStep)")
        for s in out.rows:
            mark(s, "StepRow objects")
            mark(s.token_ids, "StepRow.token_ids")
            mark(s.prompt_logprob_targets, "StepRow.prompt_logprob_targets")
    return owners


def walk(engine: LLMEngine, caller: list[Any]) -> dict[str, list[int]]:
    """owner -> [tracked objects, references walked, list items] over the collector's generations."""
    owners = engine_owners(engine, caller)
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for obj in gc.get_objects():
        label = owners.get(id(obj))
        if label is None:
            label = f"other: {type(obj).__name__}"
        row = table[label]
        row[0] += 1
        row[1] += len(gc.get_referents(obj))
        if type(obj) is list:
            row[2] += len(obj)
    return table


def time_full_collection() -> tuple[float, float]:
    """(first gc.collect(2) in ms, best of the next two)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect(2)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], min(times[1:])


def report(moment: str, table: dict[str, list[int]], gc_ms: tuple[float, float], top: int) -> None:
    total = [sum(r[i] for r in table.values()) for i in range(3)]
    print(f"\n== {moment}: {total[0]:,} tracked objects, {total[1]:,} references walked, {total[2]:,} list items; "
          f"gc.collect(2): {gc_ms[0]:.1f} ms (first), {gc_ms[1]:.1f} ms (best of two more)")
    print(f"   {'owner':58s} {'objects':>9s} {'refs walked':>12s} {'list items':>11s}")
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    for label, (n, refs, items) in rows[:top]:
        print(f"   {label:58s} {n:9,d} {refs:12,d} {items:11,d}")
    rest = rows[top:]
    if rest:
        print(f"   {'(' + str(len(rest)) + ' more owners)':58s} {sum(r[1][0] for r in rest):9,d} "
              f"{sum(r[1][1] for r in rest):12,d} {sum(r[1][2] for r in rest):11,d}")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    engine = build_engine(args)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [(min(args.requests, 8), min(args.output, 4))] * args.warmup
    batches += [(args.requests, args.output)] * args.batches
    for b, (count, out_len) in enumerate(batches):
        last = b == len(batches) - 1
        caller = torch.randint(0, LLAMA_8B["vocab_size"], (count, args.prompt), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        for i, p in enumerate(caller):
            engine.add_request(f"b{b}-{i}", p, params, final_only=True)
        finished: dict[str, Any] = {}
        seen_admitted = seen_peak = False
        while len(finished) < count:
            sched = engine.scheduler
            if last and not seen_admitted and not len(sched.waiting) and \
                    all(not s.is_prefilling for s in sched.running) and len(sched.running) == count:
                seen_admitted = True
                report("admitted (every prompt computed)", walk(engine, caller), time_full_collection(), args.top)
            if last and not seen_peak and sched.running and \
                    max(len(s.output_token_ids) for s in sched.running) >= out_len - 1:
                seen_peak = True
                report(f"peak (the first request to finish holds {out_len - 1} outputs)", walk(engine, caller),
                       time_full_collection(), args.top)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        bad = [o.request_id for o in finished.values() if len(o.outputs[0].token_ids) != out_len]
        if bad:
            raise SystemExit(f"requests {bad[:5]} did not produce {out_len} tokens")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--batches", type=int, default=2,
                    help="full batches (the last one is walked): a benchmark times several in a row, and what one "
                         "batch leaves behind is walked in the next")
    ap.add_argument("--top", type=int, default=16, help="owners to list (by references walked)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    run(args)


if __name__ == "__main__":
    main()
