"""SmolLM2-135M-Instruct (the embedded default model) end to end: the offline `LLM` class, the
`wllm generate` CLI, and engine greedy outputs identical to HF transformers under chunked
prefill, prefix caching and KV pressure (swap and recompute)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from wllm.engine.config import engine_config_from_kwargs
from wllm.engine.llm_engine import LLMEngine
from wllm.entrypoints.llm import LLM
from wllm.model.default_model import default_model_path
from wllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Say hello in Spanish.",
    "What is the largest planet?", "How many legs does a spider have?", "What color is the sky?",
    "Give me a synonym for happy.", "What is the opposite of cold?", "Name a fruit that is yellow.",
    "What is the chemical symbol for gold?", "How many days are in a week?", "What do bees make?",
    "What is the freezing point of water in Celsius?",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=64 << 20, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf() -> tf.PreTrainedModel:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = tf.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(hf: tf.PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = hf(torch.tensor([ids]), use_cache=True)
            past, toks = res.past_key_values, [int(res.logits[0, -1].argmax())]
            while len(toks) < NEW_TOKENS:
                res = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
                toks.append(int(res.logits[0, -1].argmax()))
            out.append(toks)
    return out


def test_chat_and_generate(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    outs = llm.generate(["The capital of France is", "One, two, three,"], SamplingParams(temperature=0, max_tokens=5))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert all(o.outputs[0].text for o in outs)
    many = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS[:3]],
                    SamplingParams(temperature=0, max_tokens=4))
    assert len(many) == 3


def test_prompt_forms_and_bad_token_ids(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.get_tokenizer().encode("The capital of France is")
    want = llm.generate(ids, params)[0].outputs[0].token_ids
    for form in (tuple(ids), {"prompt_token_ids": ids}, [torch.tensor(ids).numpy()]):
        assert llm.generate(form, params)[0].outputs[0].token_ids == want
    for bad in ([ids + [1.5]], {"prompt_token_ids": ["1"]}, [ids + [10**9]]):
        with pytest.raises(ValueError, match="must be integers|outside the vocabulary"):
            llm.generate(bad, params)
    with pytest.raises(TypeError, match="a prompt must be"):
        llm.generate([3.5], params)
    assert not llm.engine.has_unfinished()


CONFIGS = {
    "one-step-budget": dict(max_num_batched_tokens=2048),
    "chunks-of-16-no-prefix-cache": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    # 6 blocks of 16: two 35-40 token prompts (3 blocks each) fill the pool, so prefill chunks of
    # newcomers and growing sequences force preemptions.
    "swap": dict(max_num_batched_tokens=64, num_gpu_blocks=6, num_cpu_blocks=64, enable_prefix_caching=False),
    "recompute": dict(max_num_batched_tokens=64, num_gpu_blocks=6, num_cpu_blocks=0, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_identical_to_hf(name: str, llm: LLM, prompts, reference) -> None:
    base = llm.engine
    engine = LLMEngine(base.model, base.tokenizer, engine_config_from_kwargs(**CONFIGS[name]),
                       eos_token_ids=base.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    pending = list(enumerate(prompts))
    final = {}
    while pending or engine.has_unfinished():
        for _ in range(3):  # staggered arrival: three new requests per step
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
    assert [final[i].outputs[0].token_ids for i in range(len(prompts))] == reference
    stats = engine.stats()
    if name == "swap":
        assert stats["num_preemptions_swap"] > 0
    if name == "recompute":
        assert stats["num_preemptions_recompute"] > 0
    if name == "one-step-budget":
        assert stats["prefix_cache_hits"] > 0  # the chat template's system prompt is shared
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_cli_generate_prints_a_coherent_answer(capsys: pytest.CaptureFixture[str]) -> None:
    from wllm.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "32", "--device", "cpu"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_beam_search_equals_transformers(llm: LLM, hf: tf.PreTrainedModel, prompts: list[list[int]]) -> None:
    """`LLM.beam_search` returns the beams of transformers' num_beams search (tests/test_beam_search.py has the
    rules in detail on tiny models)."""
    from model_utils import one_thread
    from test_beam_search import MAX_NEW, hf_beams

    from wllm.sampling_params import BeamSearchParams

    tok = llm.get_tokenizer()
    eos = list(llm.engine.eos_token_ids)
    for width, lp in [(2, 1.0), (4, 0.8)]:
        with one_thread():
            outs = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=width, max_tokens=MAX_NEW,
                                                                 length_penalty=lp))
            refs = [hf_beams(hf, ids, width, width, eos, lp) for ids in prompts[:2]]
        for out, (want, scores) in zip(outs, refs):
            assert [s.token_ids for s in out.sequences] == want
            assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-3)
            assert out.sequences[0].text == tok.decode(want[0], skip_special_tokens=True)
    s = llm.engine.scheduler
    assert not s.seqs and s.kv.num_free_blocks == s.kv.pool.num_blocks
