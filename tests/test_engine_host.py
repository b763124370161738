"""Engine defaults and host-side bookkeeping of the step loop (no model time involved)."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import engine_for, make_prompts, tiny

from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig, default_batched_tokens
from wllm.engine.llm_engine import LLMEngine
from wllm.model.loader import load_model
from wllm.sampling_params import SamplingParams


@pytest.mark.parametrize("sms,budget", [(132, 8448), (108, 6912), (114, 7296), (128, 8192), (84, 10752),
                                        (46, 8832), (1, 8192), (200, 12800), (300, 19200), (0, 8192), (None, 8192)])
def test_cuda_batched_tokens_default_is_whole_waves_nearest_8192(sms, budget):
    """On CUDA the default budget is the multiple of 64 rows per SM nearest 8192 (at least one), so a
    full step's GEMMs fill whole waves; unknown SM counts keep 8192."""
    assert default_batched_tokens("cuda", sms) == budget
    if sms:
        assert budget % (64 * sms) == 0


def test_batched_tokens_default_depends_on_device_and_explicit_value_wins(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    assert default_batched_tokens("cuda") == 8192 and default_batched_tokens("cpu") == 2048
    assert default_batched_tokens("cpu", 132) == 2048
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


TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "vocab_size": 300,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def test_close_frees_an_engine_caught_in_a_cycle_and_refuses_more_work(tmp_path_factory, monkeypatch):
    """An engine frozen at start-up and then caught in a reference cycle (a callback stored on it that
    refers back to it) is never collected; `close` drops its model and caches at once, collects the
    cycle, aborts what was queued, and turns later calls into a clear error."""
    import gc
    import weakref

    from wllm.engine import EngineClosedError, llm_engine

    monkeypatch.setattr(llm_engine, "_open_engines", weakref.WeakSet())  # engines other tests left open don't count
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("close")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG), encoding="utf-8")
    model = load_model(folder, dtype="float32", load_format="dummy").model  # this test's own: not cached
    engine = LLMEngine(model, None, EngineConfig())
    other = LLMEngine(tiny("llama", tmp_path_factory)[0], None, EngineConfig())  # still open after the close
    engine.callbacks = [engine]  # the cycle: engine -> its list -> engine
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=4))
    engine.step()
    engine.add_request("b", [3, 4], SamplingParams(max_tokens=4))
    cache, runner = weakref.ref(engine.worker.kv_cache), weakref.ref(engine.worker)
    del model
    model_ref = weakref.ref(engine.model)
    engine_ref = weakref.ref(engine)
    gc.collect()
    assert model_ref() is not None and cache() is not None
    engine.close()
    engine.close()  # again: nothing
    assert model_ref() is None and cache() is None and runner() is not None
    assert not engine.has_unfinished()
    with pytest.raises(EngineClosedError, match="closed"):
        engine.add_request("c", [3], SamplingParams())
    with pytest.raises(EngineClosedError):
        engine.step()
    assert gc.get_freeze_count() > 0  # `other` still runs: its objects are frozen again (the closed shell too)
    del engine
    assert other.generate([[3, 4, 5]], SamplingParams(max_tokens=2))[0].finished
    other.close()  # the last open engine: nothing is frozen again, and the closed shell's cycle is collected
    assert gc.get_freeze_count() == 0 and engine_ref() is None


def test_llm_as_a_context_manager_closes_its_engine():
    from wllm import LLM
    from wllm.engine import EngineClosedError

    with LLM("smollm2-135m", load_format="dummy", device="cpu", kv_cache_memory=1 << 20) as llm:
        assert len(llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3
    assert llm.engine.closed and llm.engine.model is None
    with pytest.raises(EngineClosedError):
        llm.generate([[3, 4]])


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
        runner = CudaStepRunner(model, engine.worker.kv_cache, max_num_batched_tokens=64, max_num_seqs=8,
                                max_model_len=engine.max_model_len, enforce_eager=True)
        engine.worker.runner = runner
        return engine

    prompts = make_prompts(12)
    in_turn = build(False).generate(prompts, greedy(6))
    engine = build(True)
    events = []
    monkeypatch.setattr(llm_engine, "_GENERATIONAL_GC", True)
    monkeypatch.setattr(llm_engine, "gc", FakeGC(events))  # a full collection is always due
    launch, collect = engine.worker.launch, engine.worker.collect

    def spy_launch(out, prev=None):
        events.append(("launch ahead" if out.in_flight else "launch", id(out)))
        return launch(out, prev)

    def spy_collect(handle):
        events.append(("collect", None))
        return collect(handle)

    monkeypatch.setattr(engine.worker, "launch", spy_launch)
    monkeypatch.setattr(engine.worker, "collect", spy_collect)
    ahead = engine.generate(prompts, greedy(6))
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ahead] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in in_turn]
    kinds = [e[0] for e in events]
    assert kinds.count("gc") == kinds.count("launch ahead") > 5
    for i, kind in enumerate(kinds):
        if kind == "gc":
            assert kinds[i - 1] == "launch ahead" and kinds[i + 1] == "collect"


def _lists_holding(prompt: list[int], besides: list[list[int]]) -> list[list[int]]:
    """GC-tracked lists (what a full collection walks item by item) that start with `prompt`,
    other than the objects in `besides`."""
    import gc

    skip = {id(x) for x in besides}
    n = len(prompt)
    return [o for o in gc.get_objects() if type(o) is list and id(o) not in skip and len(o) >= n and o[:n] == prompt]


def test_engine_keeps_no_list_copy_of_a_running_prompt(tmp_path_factory):
    """A full GC collection walks every item of every live list; an offline batch's cost was the engine's
    copies of each prompt (the group's list, each sequence's prompt + outputs list). While requests run,
    the only lists holding a prompt are the caller's and, for a streaming request, the one its outputs
    carry; prefix caching (blocks of 4, a shared prefix), forks and outputs stay as before."""
    import gc

    from test_engine import CharTokenizer

    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    engine = engine_for(model, tokenizer=CharTokenizer(), budget=64)
    shared = make_prompts()[1][:12]
    prompts = [shared + [5 + i] * 30 for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("offline", prompts[0], params, final_only=True)
    engine.add_request("stream", prompts[1], params)
    engine.add_request("forks", prompts[2], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6,
                                                             ignore_eos=True), final_only=True)
    streamed = {}
    for _ in range(3):  # prompts computed, forks made, a few tokens out: every request still running
        for out in engine.step():
            streamed[out.request_id] = out
    assert not streamed.get("offline") and not streamed["stream"].finished
    gc.collect()
    assert _lists_holding(prompts[0], [prompts[0]]) == []
    assert _lists_holding(prompts[2], [prompts[2]]) == []
    assert _lists_holding(prompts[1], [prompts[1]]) == [streamed["stream"].prompt_token_ids]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for rid, prompt in zip(("offline", "stream", "forks"), prompts):
        out = final[rid]
        assert type(out.prompt_token_ids) is list and out.prompt_token_ids == prompt
        assert all(type(c.token_ids) is list and len(c.token_ids) == 6 for c in out.outputs)
    assert len(final["forks"].outputs) == 2
    assert engine.stats()["prefix_cache_hits"] > 0  # the shared 12-token prefix: 3 blocks of 4


def test_finished_and_aborted_requests_are_freed_without_the_cyclic_gc(tmp_path_factory):
    """A request's group and sequences reference each other; left as a cycle, every finished request
    lived on until a full collection, which then walked it (an offline batch's first full collection
    walked the whole previous batch). Finishing, forking and aborting must free them by reference
    counting alone."""
    import gc
    import weakref

    from test_engine import CharTokenizer

    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    engine = engine_for(model, tokenizer=CharTokenizer())
    prompts = make_prompts()[:4]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        engine.add_request("plain", prompts[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                           final_only=True)
        engine.add_request("forks", prompts[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4))
        engine.add_request("stop", prompts[2], SamplingParams(temperature=0.0, max_tokens=8,
                                                              stop=[chr(0x100 + t) for t in range(300)]))
        engine.add_request("aborted", prompts[3], SamplingParams(temperature=0.0, max_tokens=50))
        groups = dict(engine.scheduler.groups)
        refs = [weakref.ref(g) for g in groups.values()] + [weakref.ref(g.seqs[0]) for g in groups.values()]
        stop_seq = weakref.ref(groups["stop"].seqs[0])
        # Prompts in, forks made, "stop" done (any character is a stop string).
        final = {out.request_id: out for out in engine.step() if out.finished}
        refs += [weakref.ref(s) for s in groups["forks"].seqs[1:]]
        assert len(refs) == 4 + 6
        del groups
        aborted = engine.abort("aborted")
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert final["stop"].outputs[0].finish_reason == "stop" and stop_seq() is None
        assert len(final["forks"].outputs) == 3 and len(final["plain"].outputs[0].token_ids) == 5
        alive = [r() for r in refs if r() is not None]
        assert alive == [], alive
    finally:
        if was_enabled:
            gc.enable()
