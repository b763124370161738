"""Engine defaults and host-side bookkeeping of the step loop (no model time involved)."""

from __future__ import annotations

import torch
from test_engine import engine_for, make_prompts, tiny

from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig, default_batched_tokens
from wllm.engine.llm_engine import LLMEngine


def test_batched_tokens_default_depends_on_device_and_explicit_value_wins(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    assert default_batched_tokens("cuda") == 8192 and default_batched_tokens("cpu") == 2048
    config = EngineConfig()
    engine = LLMEngine(model, None, config)
    assert engine.scheduler.config.max_num_batched_tokens == 2048  # the tiny model is on the CPU
    assert config.scheduler.max_num_batched_tokens is None  # the caller's config is not modified
    explicit = LLMEngine(model, None, EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=300)))
    assert explicit.scheduler.config.max_num_batched_tokens == 300
    assert engine_for(model, budget=7).scheduler.config.max_num_batched_tokens == 7


def test_engine_start_freezes_long_lived_objects_out_of_the_cyclic_gc(tmp_path_factory):
    """After start-up every object alive (libraries, the model) sits in the GC's permanent generation,
    so full collections while serving scan only what requests create; garbage cycles made before the
    engine are collected, not frozen."""
    import gc
    import weakref

    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a garbage cycle once the names go
    probe = weakref.ref(a)
    del a, b
    LLMEngine(model, None, EngineConfig())
    assert probe() is None
    frozen = gc.get_freeze_count()
    assert frozen > 1000
    assert gc.is_tracked(model) and len(gc.get_objects(generation=2)) < frozen


class FakeGC:
    """Stands in for the `gc` module inside llm_engine: counters set by the test, collections recorded."""

    def __init__(self, events, count=(0, 0, 10), threshold=(700, 10, 10), enabled=True):
        self.events, self.count, self.threshold, self.enabled = events, count, threshold, enabled

    def isenabled(self):
        return self.enabled

    def get_threshold(self):
        return self.threshold

    def get_count(self):
        return self.count

    def collect(self, generation=2):
        self.events.append(("gc", generation))
        return 0


def test_collect_garbage_if_due_runs_only_the_full_collection_cpython_is_about_to_run(monkeypatch):
    from wllm.engine import llm_engine

    events = []
    monkeypatch.setattr(llm_engine, "_GENERATIONAL_GC", True)
    for count, enabled, ran in (((0, 0, 9), True, False),  # not due yet
                                ((0, 0, 10), True, True),  # due within the next few triggers
                                ((0, 0, 11), True, True),  # due at the next trigger
                                ((0, 0, 12), True, False),  # CPython is skipping full collections: its call
                                ((0, 0, 10), False, False)):  # the application turned the GC off
        monkeypatch.setattr(llm_engine, "gc", FakeGC(events, count=count, enabled=enabled))
        events.clear()
        assert llm_engine.collect_garbage_if_due() is ran
        assert events == ([("gc", 2)] if ran else [])
    monkeypatch.setattr(llm_engine, "gc", FakeGC(events, count=(0, 0, 10), threshold=(700, 10, 0)))
    events.clear()
    assert not llm_engine.collect_garbage_if_due() and not events  # no generation-2 threshold


def test_a_due_full_collection_runs_while_two_steps_are_queued_and_outputs_stay_the_same(monkeypatch,
                                                                                         tmp_path_factory):
    """With async scheduling a full GC pause belongs right after a step was launched ahead, before the
    wait for the step before it (the device then has both queued), never while the host processes
    results with only one step queued; and where it runs changes no output."""
    from test_engine_lookahead import greedy

    from wllm.engine import llm_engine
    from wllm.engine.cuda_runner import CudaStepRunner

    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)

    def build(async_on):
        # The kernel step path on the CPU (kernel references), run eagerly: it launches steps ahead.
        config = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=256, num_cpu_blocks=0),
                              scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                              async_scheduling=async_on)
        engine = LLMEngine(model, None, config)
        runner = CudaStepRunner(model, engine.runner.kv_cache, max_num_batched_tokens=64, max_num_seqs=8,
                                max_model_len=engine.max_model_len, enforce_eager=True)
        engine.runner.cuda_runner = runner
        return engine

    prompts = make_prompts(12)
    in_turn = build(False).generate(prompts, greedy(6))
    engine = build(True)
    events = []
    monkeypatch.setattr(llm_engine, "_GENERATIONAL_GC", True)
    monkeypatch.setattr(llm_engine, "gc", FakeGC(events))  # a full collection is always due
    launch, collect = engine.runner.launch, engine.runner.collect

    def spy_launch(out, prev=None):
        events.append(("launch ahead" if out.prev_rows is not None else "launch", id(out)))
        return launch(out, prev)

    def spy_collect(handle):
        events.append(("collect", None))
        return collect(handle)

    monkeypatch.setattr(engine.runner, "launch", spy_launch)
    monkeypatch.setattr(engine.runner, "collect", spy_collect)
    ahead = engine.generate(prompts, greedy(6))
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ahead] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in in_turn]
    kinds = [e[0] for e in events]
    assert kinds.count("gc") == kinds.count("launch ahead") > 5
    for i, kind in enumerate(kinds):
        if kind == "gc":
            assert kinds[i - 1] == "launch ahead" and kinds[i + 1] == "collect"
