"""LLMEngine end to end on tiny random models against HF transformers (greedy, float32).

Every test ends with all KV blocks (GPU and CPU pool) free and no request left.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_utils import VOCAB, hf_greedy, hf_logits, tiny_hf_model

from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from wllm.engine.llm_engine import LLMEngine
from wllm.model.loader import load_model
from wllm.outputs import ListPrefix
from wllm.sampling_params import SamplingParams

MAX_TOKENS = 8


class CharTokenizer:
    """Token i <-> the character U+0100 + i, so text and ids map one to one."""

    eos_token_ids = [2]
    byte_fallback_ids = frozenset()
    all_special_ids = frozenset([2])

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + i) for i in ids if not (skip_special_tokens and i in self.eos_token_ids))


def make_prompts(n=16, seed=3):
    """Random prompts of 1..30 tokens; every other one starts with a shared 12-token prefix."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(1, 19, (1,), generator=gen))
        tail = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


_MODELS: dict[str, object] = {}


def tiny(name, tmp_path_factory):
    """(our model, HF model) for a tiny architecture, loaded through wLLM's loader."""
    if name not in _MODELS:
        hf = tiny_hf_model(name)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(path)
        _MODELS[name] = (load_model(path, dtype="float32").model, hf)
    return _MODELS[name]


_REFS: dict[str, list[list[int]]] = {}


def reference(name, hf, prompts):
    if name not in _REFS:
        _REFS[name] = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return _REFS[name]


def engine_for(model, *, budget=2048, blocks=256, block_size=4, cpu_blocks=0, caching=True, seqs=256,
               tokenizer=None):
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_gpu_blocks=blocks, num_cpu_blocks=cpu_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs),
    )
    return LLMEngine(model, tokenizer, config)


def assert_all_free(engine):
    s = engine.scheduler
    assert not s.has_unfinished() and not s.seqs
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)
    assert len(s.cpu_free) == s.num_cpu_blocks


def run_staggered(engine, prompts, params, per_step=2):
    """Add `per_step` requests before each step until all are in; collect final outputs. `params`
    is one SamplingParams for all prompts or a list with one per prompt."""
    pending = list(enumerate(prompts))
    final = {}
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
    return [final[i] for i in range(len(prompts))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (architecture, token budget per step, prefix caching, number of prompts). A budget of one token
# runs one token per step, so it gets fewer prompts to stay fast.
CASES = [
    ("llama", 1, True, 6),
    ("llama", 5, True, 16),
    ("llama", 5, False, 16),
    ("llama", 2048, True, 16),
    ("llama", 2048, False, 16),
    ("gemma2", 7, True, 16),
    ("gemma2", 2048, False, 16),
    ("qwen2", 5, True, 16),
    ("mistral", 6, True, 16),  # sliding window 8 through the fused SDPA path
    ("mistral", 2048, False, 16),
]


@pytest.mark.parametrize(("name", "budget", "caching", "num_prompts"), CASES)
def test_greedy_matches_hf_staggered(name, budget, caching, num_prompts, tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny(name, tmp_path_factory)
    prompts = make_prompts()[:num_prompts]
    ref = reference(name, hf, make_prompts())[:num_prompts]
    engine = engine_for(model, budget=budget, caching=caching)
    outs = run_staggered(engine, prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == ref
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = engine.stats()
    if caching:
        assert stats["prefix_cache_hits"] > 0
        assert any(o.num_cached_tokens > 0 for o in outs)
    else:
        assert stats["prefix_cache_hits"] == 0
    assert_all_free(engine)


@pytest.mark.parametrize(("cpu_blocks", "mode"), [(64, "swap"), (0, "recompute")])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_hf_under_kv_pressure(cpu_blocks, mode, caching, tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny("llama", tmp_path_factory)
    prompts = make_prompts()
    ref = reference("llama", hf, prompts)
    # 12 blocks of 4 tokens: one sequence (<= 38 tokens) always fits, sixteen cannot.
    engine = engine_for(model, budget=16, blocks=12, cpu_blocks=cpu_blocks, caching=caching)
    outs = run_staggered(engine, prompts, GREEDY, per_step=4)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = engine.stats()
    if mode == "swap":
        assert stats["num_preemptions_swap"] > 0
    else:
        assert stats["num_preemptions_recompute"] > 0 and stats["num_preemptions_swap"] == 0
    assert_all_free(engine)


def test_seeded_sampling_is_identical_alone_and_in_a_batch_of_8(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompts = make_prompts(8)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    engine = engine_for(model, budget=9)
    batch = engine.generate(prompts, params)
    for i in (0, 5):
        alone = engine_for(model).generate([prompts[i]], params[i])[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    # Different seeds really do give different samples.
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) == 8
    assert_all_free(engine)


def test_n_sequences_share_the_prompt_blocks(tmp_path_factory):
    torch.manual_seed(0)
    model, _ = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[1]  # 12 + k tokens
    engine = engine_for(model, caching=False)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()  # the prompt runs once and three first tokens are sampled
    group = engine.scheduler.groups["r"]
    assert len(group.seqs) == 3
    full = len(prompt) // 4
    shared = [b.block_id for b in group.seqs[0].blocks[:full]]
    assert all([b.block_id for b in s.blocks[:full]] == shared for s in group.seqs)
    assert engine.stats()["prompt_tokens"] == len(prompt)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert [c.index for c in final.outputs] == [0, 1, 2]
    single = engine_for(model).generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=7,
                                                                 ignore_eos=True))[0]
    assert final.outputs[0].token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    assert_all_free(engine)


def test_logprobs_and_prompt_logprobs_match_hf(tmp_path_factory):
    torch.manual_seed(0)
    model, hf = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[3]
    engine = engine_for(model, budget=5)  # prompt logprobs computed across several chunks
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    comp = out.outputs[0]
    full = prompt + comp.token_ids
    ref = torch.log_softmax(hf_logits(hf, full), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        step = out.prompt_logprobs[j]
        assert step.token_id == prompt[j]
        assert step.logprob == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
        assert [t.token_id for t in step.top] == ref[j - 1].topk(2).indices.tolist()
    for k, step in enumerate(comp.logprobs):
        row = ref[len(prompt) - 1 + k]
        assert step.token_id == comp.token_ids[k] and step.rank == 1
        assert step.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t.token_id for t in step.top] == row.topk(3).indices.tolist()
    assert comp.cumulative_logprob == pytest.approx(sum(s.logprob for s in comp.logprobs))
    assert_all_free(engine)


def test_abort_frees_blocks_within_one_step(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = engine_for(model, budget=8)
    engine.add_request("a", make_prompts()[1], GREEDY)
    engine.add_request("b", make_prompts()[3], GREEDY)
    engine.step()
    assert engine.scheduler.kv.num_free_blocks < 256
    out = engine.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort("unknown") is None
    engine.abort("b")
    assert_all_free(engine)


@contextlib.contextmanager
def poisoned_forward(model, poison: int):
    """While active, the model's forward raises RuntimeError("poisoned batch") for any batch holding the
    token `poison` (a failing step), and runs normally otherwise."""
    real_forward = model.forward

    def forward(input_ids, positions, ctx):
        if (input_ids == poison).any():
            raise RuntimeError("poisoned batch")
        return real_forward(input_ids, positions, ctx)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def test_failing_step_fails_its_requests_and_engine_keeps_serving(tmp_path_factory):
    model, hf = tiny("llama", tmp_path_factory)
    engine = engine_for(model)
    poison = 299
    with poisoned_forward(model, poison):
        outs = engine.generate([[5, 6, poison]], GREEDY)
        assert outs[0].error == "RuntimeError: poisoned batch"
        assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
        assert engine.stats()["num_failed_steps"] == 1
        assert_all_free(engine)
        good = engine.generate([[5, 6, 7]], GREEDY)[0]
        assert good.error is None and good.outputs[0].token_ids == hf_greedy(hf, [5, 6, 7], MAX_TOKENS)
    assert_all_free(engine)


def test_text_stop_strings_and_stop_tokens_through_the_engine(tmp_path_factory):
    model, hf = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[5]
    ref = hf_greedy(hf, prompt, MAX_TOKENS)
    tok = CharTokenizer()
    engine = engine_for(model, tokenizer=tok)
    stop = tok.decode(ref[2:4])
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == tok.decode(ref[:2]) and c.token_ids == ref[:4]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                                                      include_stop_str_in_output=True))
    assert out.outputs[0].text == tok.decode(ref[:4])
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      stop_token_ids=[ref[3]]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", ref[3])
    assert c.token_ids == ref[:4] and c.text == tok.decode(ref[:3])
    (out,) = engine.generate([tok.decode(prompt)], SamplingParams(temperature=0, max_tokens=3))
    assert out.outputs[0].text == tok.decode(ref[:3]) and out.outputs[0].finish_reason == "length"
    assert_all_free(engine)


def test_streaming_never_shows_a_partial_stop_string(tmp_path_factory):
    model, hf = tiny("llama", tmp_path_factory)
    prompt = make_prompts()[7]
    ref = hf_greedy(hf, prompt, MAX_TOKENS)
    tok = CharTokenizer()
    engine = engine_for(model, tokenizer=tok)
    stop = tok.decode(ref[3:6])
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]))
    texts = []
    while engine.has_unfinished():
        texts.extend(o.outputs[0].text for o in engine.step())
    assert texts[-1] == tok.decode(ref[:3])
    assert all(t == texts[-1][: len(t)] for t in texts)  # each stream text is a prefix of the final
    assert tok.decode(ref[3:4]) not in "".join(texts)
    assert_all_free(engine)


def test_final_only_requests_report_once_with_the_same_text(tmp_path_factory):
    """final_only: no per-step outputs, text decoded once at the end, identical to the streamed text;
    an abort mid-way still returns the text of the tokens so far."""
    model, hf = tiny("llama", tmp_path_factory)
    prompts = make_prompts()[:3]
    tok = CharTokenizer()
    engine = engine_for(model, tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(prompts):
        engine.add_request(f"stream{i}", p, params)
        engine.add_request(f"final{i}", p, params, final_only=True)
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i in range(len(prompts)):
        (final,) = seen[f"final{i}"]
        streamed = seen[f"stream{i}"]
        assert len(streamed) == MAX_TOKENS and final.finished
        assert final.outputs[0].text == streamed[-1].outputs[0].text != ""
        assert final.outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    engine.add_request("cut", prompts[0], params, final_only=True)
    for _ in range(3):
        assert engine.step() == []
    cut = engine.abort("cut")
    assert cut.finished and cut.outputs[0].token_ids and cut.outputs[0].text == tok.decode(cut.outputs[0].token_ids)
    assert_all_free(engine)


def test_bad_requests_get_clear_errors(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    engine = engine_for(model, blocks=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [VOCAB + 5], GREEDY)
    with pytest.raises(ValueError, match=r"\[-1\] are outside the vocabulary"):
        engine.add_request("x", [3, -1, 4], GREEDY)
    for bad in ([3, 1.5], [3, "4"], [3, None]):
        with pytest.raises(ValueError, match="must be integers"):
            engine.add_request("x", bad, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [2**70], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("x", "hello", GREEDY)
    with pytest.raises(ValueError, match="at most 31 prompt tokens"):
        engine.add_request("x", list(range(3, 40)), GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("x", [3], SamplingParams(temperature=-1))
    assert_all_free(engine)


def test_streamed_outputs_are_snapshots_without_per_step_copies(tmp_path_factory):
    """A running request's outputs view the engine's growing token and logprob lists (no copy per step):
    each keeps showing what it showed when it was made, slices take only the new part, and the final
    output carries real lists equal to the streamed ones."""
    model, _ = tiny("llama", tmp_path_factory)
    engine = engine_for(model, budget=5)  # prompt logprobs over several chunks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    prompt = make_prompts()[3]
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    *running, final = outs
    assert running and final.finished
    ids, lps = final.outputs[0].token_ids, final.outputs[0].logprobs
    assert type(ids) is list and type(lps) is list and type(final.prompt_logprobs) is list
    assert len(ids) == MAX_TOKENS and len(final.prompt_logprobs) == len(prompt)
    sent = 0
    for out in running:
        c = out.outputs[0]
        assert isinstance(c.token_ids, ListPrefix) and isinstance(c.logprobs, ListPrefix)
        n = len(c.token_ids)
        assert c.token_ids == ids[:n] and list(c.token_ids) == ids[:n] and ids[:n] == c.token_ids
        assert c.logprobs == lps[:n] and len(c.logprobs) == n
        assert c.token_ids[sent:] == ids[sent:n] and c.token_ids[-1] == ids[n - 1]
        sent = n
    assert sent == MAX_TOKENS - 1
    assert_all_free(engine)


def test_list_prefix_behaves_as_a_read_only_list_prefix():
    items = [10, 11, 12, 13]
    view = ListPrefix(items, 3)
    items.append(14)  # the list grows underneath; the view keeps its length
    assert len(view) == 3 and view == [10, 11, 12] and [10, 11, 12] == view and view != [10, 11, 12, 13]
    assert view != (10, 11, 12) and view == ListPrefix([10, 11, 12, 99], 3)  # a list is not equal to a tuple
    assert view[0] == 10 and view[-1] == 12 and view[-3] == 10
    for bad in (3, -4, 100):
        with pytest.raises(IndexError):
            view[bad]
    assert view[1:] == [11, 12] and view[:] == [10, 11, 12] and view[5:] == [] and view[::-1] == [12, 11, 10]
    assert view[-2:] == [11, 12] and view[::2] == [10, 12] and type(view[1:]) is list
    assert list(view) == [10, 11, 12] and list(reversed(view)) == [12, 11, 10] and 12 in view and 13 not in view
    assert view.index(11) == 1 and view.count(10) == 1 and repr(view) == "[10, 11, 12]"
    assert len(ListPrefix(items)) == 5 and ListPrefix([], 0) == []
    import pickle

    assert pickle.loads(pickle.dumps(view)) == [10, 11, 12] and type(pickle.loads(pickle.dumps(view))) is list
    with pytest.raises(TypeError):
        hash(view)
    with pytest.raises(TypeError):
        view[0] = 1  # read-only


def test_priority_without_the_priority_policy_is_refused_not_ignored(tmp_path_factory):
    model, _ = tiny("llama", tmp_path_factory)
    fcfs = LLMEngine(model, None, EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=64)))
    with pytest.raises(ValueError, match="priority scheduling policy"):
        fcfs.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), priority=2)
    fcfs.add_request("b", [1, 2, 3], SamplingParams(max_tokens=1), priority=0)
    by_priority = LLMEngine(model, None, EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=64),
                                                      scheduler=SchedulerConfig(policy="priority")))
    by_priority.add_request("c", [1, 2, 3], SamplingParams(max_tokens=1), priority=2)
    assert len(by_priority.scheduler.waiting) == 1
