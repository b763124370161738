"""Structured output below the HTTP layer: grammar builders, the compiler and its cache, the bitmask
reference, the sampler's masking, the scheduler's matchers, and the engine end to end on tiny models."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import llguidance
import pytest
import torch

from wllm.engine.sampler import Sampler, SamplingRow
from wllm.kernels import reference
from wllm.model.default_model import default_model_path
from wllm.model.tokenizer import Tokenizer
from wllm.sampling_params import SamplingParams
from wllm.structured import GrammarCompiler, GrammarError
from wllm.structured import grammars as g
from wllm.structured.masks import MaskFiller


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, [2])


def run_grammar(compiler: GrammarCompiler, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of `text` accepted, grammar complete afterwards) for a fresh matcher."""
    m = compiler.compile(grammar).new_matcher()
    ids = compiler.ll_tokenizer.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids), m.is_accepting()


def test_builders_accept_what_they_describe_and_nothing_else(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}, "required": ["n"]}
    assert run_grammar(compiler, g.json_schema_grammar(schema), '{"n": 3}') == (True, True)
    assert run_grammar(compiler, g.json_schema_grammar(json.dumps(schema)), '{"n": 9}')[1] is False
    # Whitespace is fixed: no free spaces or newlines anywhere in a JSON value.
    assert run_grammar(compiler, g.json_schema_grammar(schema), '{ "n": 3}')[0] is False
    assert run_grammar(compiler, g.json_schema_grammar(schema), '{"n":\n3}')[0] is False
    assert run_grammar(compiler, g.json_object_grammar(), '{"a": [1, 2]}') == (True, True)
    assert run_grammar(compiler, g.regex_grammar(r"\d{3}-\d{2}"), "123-45") == (True, True)
    assert run_grammar(compiler, g.regex_grammar(r"\d{3}-\d{2}"), "12a")[0] is False
    assert run_grammar(compiler, g.choice_grammar(["red", "green"]), "green") == (True, True)
    assert run_grammar(compiler, g.choice_grammar(["red", "green"]), "blue")[0] is False
    assert run_grammar(compiler, g.lark_grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x42") == (True, True)
    # GBNF as llama.cpp users write it, and Lark through the same field.
    assert run_grammar(compiler, g.gbnf_grammar('root ::= "yes" | "no"'), "no") == (True, True)
    assert run_grammar(compiler, g.gbnf_grammar('root ::= [a-c]+ "!"'), "abca!") == (True, True)
    assert run_grammar(compiler, g.gbnf_grammar('start: "a" "b"'), "ab") == (True, True)
    assert g.response_format_grammar({"type": "text"}) is None


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda: g.json_schema_grammar("{not json"), "not valid JSON"),
    (lambda: g.json_schema_grammar([1, 2]), "must be an object"),
    (lambda: g.choice_grammar([]), "non-empty list"),
    (lambda: g.regex_grammar(""), "non-empty"),
    (lambda: g.gbnf_grammar("root ::= ("), "GBNF"),
    (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {"name": "x"}}), "needs a `schema`"),
    (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}), "unknown"),
    (lambda: g.response_format_grammar({"type": "yaml"}), "not supported"),
])
def test_malformed_constraints_are_refused_before_compiling(make, fragment: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(fragment)):
        make()


@pytest.mark.parametrize(("grammar", "fragment"), [
    (g.regex_grammar("(abc"), "unclosed group"),
    (g.json_schema_grammar({"type": "strin"}), "strin"),
    # Overlapping oneOf branches cannot be enforced exactly: refused, not approximated by anyOf.
    (g.json_schema_grammar({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}), "oneOf"),
    (g.json_schema_grammar({"type": "object", "if": {}}), "if"),
    (g.lark_grammar("start: undefined_rule"), "undefined_rule"),
])
def test_grammars_that_do_not_compile_are_errors_and_cached(compiler: GrammarCompiler, grammar: str,
                                                             fragment: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(fragment)):
        compiler.compile(grammar)
    before = compiler.num_compiled
    with pytest.raises(GrammarError, match=re.escape(fragment)):
        asyncio.run(compiler.compile_async(grammar))
    assert compiler.num_compiled == before  # the failure came from the cache


def test_cache_size_limit_and_deadline(tokenizer: Tokenizer) -> None:
    c = GrammarCompiler(tokenizer, tokenizer.vocab_size, [2], cache_size=2, max_grammar_bytes=200)
    a, b, d = (g.regex_grammar(x) for x in ("a+", "b+", "c+"))
    first = c.compile(a)
    assert c.compile(a) is first and c.num_compiled == 1
    c.compile(b)
    c.compile(d)  # evicts a (least recently used)
    assert c.compile(a) is not first and c.num_compiled == 4
    with pytest.raises(GrammarError, match="over this server's limit of 200"):
        c.compile(g.choice_grammar(["x" * 300]))
    # A deadline no compile can meet: refused, and the late result is not cached as a success.
    slow = GrammarCompiler(tokenizer, tokenizer.vocab_size, [2], timeout_s=1e-9)
    grammar = g.json_schema_grammar({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}})
    with pytest.raises(GrammarError, match="limit of"):
        asyncio.run(slow.compile_async(grammar))
    time.sleep(0.5)
    with pytest.raises(GrammarError, match="limit of"):
        slow.compile(grammar)


def test_bitmask_reference_matches_a_loop_on_odd_sizes() -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, vocab, slots in ((1, 1, 1), (3, 33, 2), (5, 1000, 3), (4, 4097, 4)):
        words = (vocab + 31) // 32 + (vocab % 7 == 0)  # sometimes more words than the vocabulary needs
        bitmask = torch.randint(-(2**31), 2**31 - 1, (slots, words), dtype=torch.int32, generator=gen)
        index = torch.randint(-1, slots, (rows,), dtype=torch.int32, generator=gen)
        logits = torch.randn(rows, vocab, generator=gen)
        want = logits.clone()
        for r in range(rows):
            if index[r] < 0:
                continue
            for v in range(vocab):
                if not (int(bitmask[index[r], v // 32]) >> (v % 32)) & 1:
                    want[r, v] = float("-inf")
        got = logits.clone()
        reference.apply_token_bitmask(got, bitmask, index)
        assert torch.equal(got, want)
        # Fewer words than the vocabulary needs: the tokens past them are masked.
        short = logits.clone()
        reference.apply_token_bitmask(short, bitmask[:, : max(1, words // 2)], torch.zeros(rows, dtype=torch.int32))
        assert torch.isinf(short[:, 32 * max(1, words // 2):]).all()


def _row(params: SamplingParams, outputs: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, 7, 0, (1, 2, 3), outputs or [], [0])


def test_sampler_masks_after_penalties_and_leaves_allowed_argmax_alone() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]])
    allow_13 = torch.tensor([[0b1010]], dtype=torch.int32)
    allow_23 = torch.tensor([[0b1100]], dtype=torch.int32)
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler()
    out = sampler(logits, [_row(greedy), _row(greedy)], allow_13, [0, -1])
    assert [t.token_id for t in out] == [1, 1]  # the argmax is allowed: unchanged; the other row is free
    out = sampler(logits, [_row(greedy), _row(greedy)], allow_23, [0, -1])
    assert [t.token_id for t in out] == [3, 1]
    # Reported logprobs stay the model's raw ones.
    assert out[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[3].item())
    # Random rows never draw a masked token; a logit_bias cannot lift a masked token back.
    hot = SamplingParams(temperature=2.0, seed=1, logit_bias={1: 100.0})
    for seed in range(20):
        row = SamplingRow(hot, seed, 0, (1,), [], [0])
        assert sampler(logits[:1], [row], allow_23, [0])[0].token_id in (2, 3)


def test_mask_filler_fills_batched_masks_in_a_thread(compiler: GrammarCompiler) -> None:
    tok = compiler.ll_tokenizer
    filler = MaskFiller(tok.vocab_size)
    ms = [compiler.compile(g.choice_grammar(["hello"])).new_matcher(),
          compiler.compile(g.regex_grammar("[0-9]+")).new_matcher()]
    masks = filler.start(ms).wait()
    assert masks.shape == (2, (tok.vocab_size + 31) // 32)
    for i, m in enumerate(ms):
        # compute_bitmask may return a spare word past the vocabulary's
        want = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)[: masks.shape[1]]
        assert torch.equal(masks[i], want) and want.any()
    filler.close()


def test_ll_tokenizer_round_trips_the_gguf_vocabulary(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    text = 'Héllo, wörld! {"a": [1, 2]} 日本'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert compiler.ll_tokenizer.decode_str(ids) == text
    assert isinstance(compiler.ll_tokenizer, llguidance.LLTokenizer)
    jsonschema.validate({"a": 1}, {"type": "object"})  # the oracle the server tests use is importable
