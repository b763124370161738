"""Engine defaults and host-side bookkeeping of the step loop (no model time involved)."""

from __future__ import annotations

import torch
from test_engine import engine_for, tiny

from wllm.engine.config import EngineConfig, SchedulerConfig, default_batched_tokens
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
