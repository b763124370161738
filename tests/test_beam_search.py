"""Beam search (wllm.engine.beam_search) against HF transformers' `generate(num_beams=W, do_sample=False)`: the
returned beams, best first, on tiny random models with EOS ids chosen so that beams do end early; length_penalty
and early_stopping variants; KV pressure (forks, swap and recompute); the async engine and both OpenAI endpoints;
refusals. Every engine ends with all KV blocks free."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from litestar.testing import TestClient
from model_utils import one_thread, prompts, stream_outputs
from test_engine import CharTokenizer, assert_all_free, tiny

from wllm.engine.async_engine import AsyncEngine
from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from wllm.engine.llm_engine import LLMEngine
from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.sampling_params import BeamSearchParams, SamplingParams

# Tokens the tiny llama's greedy continuations of PROMPTS produce early on: as EOS ids they end beams.
EOS = {"one": [79], "two": [113, 79]}
PROMPTS = prompts((20, 13, 5))
MAX_NEW = 10
VARIANTS = [(1.0, False), (1.0, "never"), (0.5, True), (2.0, "never"), (-1.0, "never"), (0.0, False)]


def beam(width: int, n: int | None = None, **kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_NEW)
    return SamplingParams(n=n or width, beam_width=width, temperature=0.0, **kw)  # type: ignore[arg-type]


def engine(model, eos: list[int], blocks: int = 256, tokenizer=None, **sched: object) -> LLMEngine:
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_gpu_blocks=blocks, num_cpu_blocks=sched.pop("cpu", 0)),
        scheduler=SchedulerConfig(**sched),
        device="cpu",
    )  # type: ignore[arg-type]
    return LLMEngine(model, tokenizer, config, eos_token_ids=eos)


@torch.no_grad()
def hf_beams(
    hf,
    ids: list[int],
    width: int,
    n: int,
    eos: list[int],
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> tuple[list[list[int]], list[float]]:
    """HF's best n beams (generated tokens, cut after their EOS) and their scores."""
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        num_beams=width,
        do_sample=False,
        num_return_sequences=n,
        max_new_tokens=MAX_NEW,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    beams = []
    for row in out.sequences[:, len(ids) :].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]  # the padding after an early end is an EOS id too
        beams.append(row[: ends[0] + 1] if ends else row)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("eos", ["one", "two"])
def test_beams_equal_transformers(tmp_path_factory, width: int, eos: str) -> None:
    model, hf = tiny("llama", tmp_path_factory)
    eng = engine(model, EOS[eos])
    ended_by_eos = 0
    with one_thread():
        for lp, es in VARIANTS:
            outs = eng.generate(PROMPTS, beam(width, length_penalty=lp, early_stopping=es))  # batched together
            for ids, out in zip(PROMPTS, outs):
                want, scores = hf_beams(hf, ids, width, width, EOS[eos], lp, es)
                got = [list(c.token_ids) for c in out.outputs]
                assert got == want, (lp, es, ids)
                for c, score in zip(out.outputs, scores):
                    assert c.cumulative_logprob / len(c.token_ids) ** lp == pytest.approx(score, abs=1e-4)
                    ended_by_eos += c.finish_reason == "stop"
                    assert c.finish_reason == ("stop" if c.token_ids[-1] in EOS[eos] else "length")
    assert ended_by_eos > 0  # the EOS rules were exercised
    assert_all_free(eng)


def test_top_n_of_a_wider_beam_and_a_second_architecture(tmp_path_factory) -> None:
    model, hf = tiny("qwen2", tmp_path_factory)
    eos = [int(t) for t in eng_greedy_tokens(model, PROMPTS[0])[:2]]
    eng = engine(model, eos)
    with one_thread():
        for ids in PROMPTS:
            out = eng.generate([ids], beam(4, n=2))[0]
            assert [list(c.token_ids) for c in out.outputs] == hf_beams(hf, ids, 4, 2, eos)[0]
    assert_all_free(eng)


def eng_greedy_tokens(model, ids: list[int]) -> list[int]:
    eng = engine(model, [])
    return list(eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids)


@pytest.mark.parametrize(("blocks", "cpu"), [(24, 0), (24, 64), (16, 0)])
def test_kv_pressure_forks_swap_and_recompute(tmp_path_factory, blocks: int, cpu: int) -> None:
    """Beam requests and a plain one share a pool too small for all beams at once (and a small token budget):
    the beams come out as without pressure, and every block is free at the end."""
    model, _ = tiny("llama", tmp_path_factory)
    ps = prompts((20, 13, 5, 9))
    params = [
        SamplingParams(n=4, beam_width=4, temperature=0.0, max_tokens=12),
        SamplingParams(n=2, beam_width=3, temperature=0.0, max_tokens=12, length_penalty=0.0),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(n=4, beam_width=4, temperature=0.0, max_tokens=12, early_stopping=True),
    ]
    with one_thread():
        roomy = engine(model, EOS["one"], blocks=512)
        want = [roomy.generate([p], [sp])[0] for p, sp in zip(ps, params)]
        tight = engine(model, EOS["one"], blocks=blocks, cpu=cpu, max_num_batched_tokens=16)
        got = tight.generate(ps, params)
    for g, w in zip(got, want):
        assert [list(c.token_ids) for c in g.outputs] == [list(c.token_ids) for c in w.outputs]
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    if cpu:
        assert stats["num_preemptions_swap"] > 0
    assert_all_free(tight)


def test_beams_share_the_prompt_blocks(tmp_path_factory) -> None:
    """While the beams run, the prompt's full blocks are held once (ref count = number of beams), not copied."""
    model, _ = tiny("llama", tmp_path_factory)
    eng = engine(model, [])
    ids = PROMPTS[0]  # 20 tokens: 5 full blocks of 4
    eng.add_request("b", ids, beam(4, max_tokens=6))
    with one_thread():
        for _ in range(4):
            eng.step()
    seqs = eng.scheduler.groups["b"].seqs
    assert len(seqs) == 4
    prompt_blocks = {b.block_id for s in seqs for b in s.blocks[:5]}
    assert len(prompt_blocks) == 5 and all(eng.scheduler.kv.pool.blocks[i].ref_cnt == 4 for i in prompt_blocks)
    out = eng.abort("b")
    assert out is not None and out.finished and all(c.finish_reason == "abort" for c in out.outputs)
    assert_all_free(eng)


def test_refusals(tmp_path_factory) -> None:
    model, _ = tiny("llama", tmp_path_factory)
    eng = engine(model, [], max_num_seqs=4)
    with pytest.raises(ValueError, match="exceeds this engine's max_num_seqs"):
        eng.add_request("w", [5, 6], beam(8))
    for kw, fragment in [
        ({"n": 3, "beam_width": 2}, "must not exceed the beam width"),
        ({"beam_width": -1}, "at least 1"),
        ({"beam_width": 2, "temperature": 1.0}, "temperature must be 0"),
        ({"beam_width": 2, "stop": ["x"]}, "stop is not supported"),
        ({"length_penalty": 2.0}, "beam search only"),
        ({"beam_width": 2, "length_penalty": float("nan")}, "finite"),
    ]:
        params = SamplingParams(**{"temperature": 0.0, **kw})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=fragment):
            eng.add_request("x", [5, 6], params)
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0).to_sampling_params()
    assert_all_free(eng)


@pytest.mark.slow
def test_async_engine_sends_the_beams_once_at_the_end(tmp_path_factory) -> None:
    model, hf = tiny("llama", tmp_path_factory)
    eng = AsyncEngine(engine(model, EOS["one"]))
    try:
        with one_thread():
            outs = asyncio.run(stream_outputs(eng, PROMPTS[1], beam(4, n=3), "a"))
    finally:
        eng.shutdown()
    assert len(outs) == 1 and outs[0].finished
    assert [list(c.token_ids) for c in outs[0].outputs] == hf_beams(hf, PROMPTS[1], 4, 3, EOS["one"])[0]
    assert_all_free(eng.engine)


class ChatCharTokenizer(CharTokenizer):
    vocab_size = 300

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        return "".join(m["content"] for m in messages)


@pytest.mark.slow
def test_openai_endpoints_return_the_beams(tmp_path_factory) -> None:
    model, hf = tiny("llama", tmp_path_factory)
    tok = ChatCharTokenizer()
    core = engine(model, EOS["one"], tokenizer=tok)
    text = tok.decode(PROMPTS[0])
    want, _ = hf_beams(hf, PROMPTS[0], 4, 2, EOS["one"], 0.5)
    want_text = [tok.decode(w) for w in want]
    body = {
        "model": "tiny",
        "use_beam_search": True,
        "n": 2,
        "best_of": 4,
        "max_tokens": MAX_NEW,
        "length_penalty": 0.5,
    }
    app = create_app(AsyncEngine(core), ServerConfig(served_model_names=["tiny"]))
    with one_thread(), TestClient(app) as client:
        r = client.post("/v1/completions", json={**body, "prompt": text})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == want_text
        assert r.json()["usage"]["completion_tokens"] == sum(len(w) for w in want)
        r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
        assert [c["message"]["content"] for c in r.json()["choices"]] == want_text
        # Streamed: each beam's text in one chunk at the end, then its own final chunk with the finish reason.
        for path, extra, field in [
            ("/v1/completions", {"prompt": text}, "text"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "content"),
        ]:
            r = client.post(path, json={**body, **extra, "stream": True})
            assert r.status_code == 200, r.text
            events = [
                json.loads(line[6:])
                for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
            texts = ["", ""]
            reasons = [None, None]
            for e in events:
                for c in e["choices"]:
                    piece = c.get("text") if field == "text" else c["delta"].get("content")
                    texts[c["index"]] += piece or ""
                    reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
            assert texts == want_text and None not in reasons
        r = client.post("/v1/completions", json={**body, "prompt": text, "best_of": 17})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert_all_free(core)

