"""Structured output below the HTTP layer: grammar builders, the compiler and its cache, the bitmask
reference, the sampler's masking, the scheduler's matchers, and the engine end to end on tiny models."""

from __future__ import annotations

import asyncio
import json
import re
import time

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


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: g.json_schema_grammar("{not json"), "not valid JSON"),
        (lambda: g.json_schema_grammar([1, 2]), "must be an object"),
        (lambda: g.choice_grammar([]), "non-empty list"),
        (lambda: g.regex_grammar(""), "non-empty"),
        (lambda: g.gbnf_grammar("root ::= ("), "GBNF"),
        (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {"name": "x"}}), "needs a `schema`"),
        (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}), "unknown"),
        (lambda: g.response_format_grammar({"type": "yaml"}), "not supported"),
    ],
)
def test_malformed_constraints_are_refused_before_compiling(make, fragment: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(fragment)):
        make()


@pytest.mark.parametrize(
    ("grammar", "fragment"),
    [
        (g.regex_grammar("(abc"), "unclosed group"),
        (g.json_schema_grammar({"type": "strin"}), "strin"),
        # Overlapping oneOf branches cannot be enforced exactly: refused, not approximated by anyOf.
        (g.json_schema_grammar({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}), "oneOf"),
        (g.json_schema_grammar({"type": "object", "if": {}}), "if"),
        (g.lark_grammar("start: undefined_rule"), "undefined_rule"),
    ],
)
def test_grammars_that_do_not_compile_are_errors_and_cached(
    compiler: GrammarCompiler, grammar: str, fragment: str
) -> None:
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
        assert torch.isinf(short[:, 32 * max(1, words // 2) :]).all()


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
    ms = [
        compiler.compile(g.choice_grammar(["hello"])).new_matcher(),
        compiler.compile(g.regex_grammar("[0-9]+")).new_matcher(),
    ]
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


# ------------------------------------------------------------------ the engine on a tiny random model
# A random model's logits go anywhere: whatever it emits under a grammar comes from the mask alone.

NUMBER_SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["a", "bb"]}, "v": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["k", "v"],
    "additionalProperties": False,
}


def _tiny_engine(tmp_path_factory, runner: str, async_on: bool):
    from model_utils import VOCAB
    from test_engine import tiny

    from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from wllm.engine.cuda_runner import CudaStepRunner
    from wllm.engine.llm_engine import LLMEngine
    from wllm.model.tokenizer.synthetic import synthetic_tokenizer

    model = tiny("llama", tmp_path_factory)[0]
    tok = synthetic_tokenizer(VOCAB)
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_gpu_blocks=256, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8),
        async_scheduling=async_on,
    )
    engine = LLMEngine(model, tok, config)
    if runner == "kernel-path":  # the CUDA runner's code on the CPU (kernel references), eager
        engine.worker.runner = CudaStepRunner(
            model,
            engine.worker.kv_cache,
            max_num_batched_tokens=24,
            max_num_seqs=8,
            max_model_len=engine.max_model_len,
            enforce_eager=True,
        )
    return engine


def _workload() -> list[SamplingParams]:
    regex = g.regex_grammar("[a-z]{2,6}")
    return [
        SamplingParams(temperature=0.0, max_tokens=30, grammar=g.json_schema_grammar(NUMBER_SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=2, grammar=regex),
        SamplingParams(temperature=0.9, seed=6, max_tokens=9),
        SamplingParams(temperature=1.0, seed=7, max_tokens=10, grammar=g.choice_grammar(["alpha", "beta", "al"])),
        SamplingParams(temperature=0.0, max_tokens=16, grammar=g.gbnf_grammar('root ::= "<" [0-9] [0-9]? ">"')),
    ]


def _check_outputs(outs) -> None:
    for out, params in zip(outs, _workload()):
        for c in out.outputs:
            if params.grammar is None:
                continue
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            text = c.text
            if params.n == 2:
                assert re.fullmatch("[a-z]{2,6}", text), text
            elif params.max_tokens == 30:
                import jsonschema  # here: the GPU machine's image may lack it, and only this check needs it

                jsonschema.validate(json.loads(text), NUMBER_SCHEMA)
            elif params.seed == 7:
                assert text in ("alpha", "beta", "al")
            else:
                assert re.fullmatch("<[0-9]{1,2}>", text), text


def _run(engine, prompts, params):
    """Staggered arrivals: one request joins every other step, so prompts, decodes and grammar rows mix."""
    pending = list(zip(range(len(prompts)), prompts, params))
    final = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            i, prompt, p = pending.pop(0)
            engine.add_request(f"r{i}", prompt, p)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["torch", "kernel-path"])
def test_engine_outputs_follow_their_grammars_alone_batched_and_ahead(tmp_path_factory, runner: str) -> None:
    prompts = [[5 + i, 40, 41 + i, 42] * (1 + i) for i in range(len(_workload()))]
    runs = {}
    for async_on in (False, True):
        engine = _tiny_engine(tmp_path_factory, runner, async_on)
        outs = _run(engine, prompts, _workload())
        _check_outputs(outs)
        runs[async_on] = (
            [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs],
            engine.num_lookahead_steps,
        )
        # Alone, each request gets the same tokens as in the batch (greedy and seeded alike).
        if not async_on:
            solo = _tiny_engine(tmp_path_factory, runner, False)
            for i in (0, 2):
                alone = solo.generate([prompts[i]], _workload()[i])[0]
                assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in outs[i].outputs]
        engine.close()
    assert runs[True][0] == runs[False][0]
    if runner == "kernel-path":
        assert runs[True][1] > 0  # the unconstrained rows still ran ahead


@pytest.mark.slow
def test_engine_compiles_off_its_loop_and_refuses_bad_grammars_later(tmp_path_factory) -> None:
    engine = _tiny_engine(tmp_path_factory, "torch", False)
    fresh = g.regex_grammar("x[0-9]{3}y")  # not in the cache: compiled in the pool while the engine goes on
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, grammar=fresh))
    rejected = []
    try:
        engine.add_request("bad", [5, 6], SamplingParams(grammar=g.regex_grammar("x(")))
    except ValueError as exc:  # the compile was already done: refused at once
        rejected.append(("bad", exc))
    engine.add_request("aborted", [5, 6], SamplingParams(grammar=g.regex_grammar("z{1,3}")))
    engine.abort("aborted")
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        rejected += engine.take_rejected()
    assert re.fullmatch(r"x[0-9]{3}y", final["ok"].outputs[0].text) and "aborted" not in final
    assert [r for r, _ in rejected] == ["bad"] and "unclosed group" in str(rejected[0][1])
    assert isinstance(rejected[0][1], ValueError)
    with pytest.raises(GrammarError, match="unclosed group"):  # offline generate raises before queueing
        engine.generate([[5, 6]], SamplingParams(grammar=g.regex_grammar("y(")))
    assert not engine.has_unfinished()


# ------------------------------------------------------------------ the CUDA kernel (-m cuda; the lead's GPU)
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "vocab", "slots", "extra_words"),
    [(1, 1, 1, 0), (3, 33, 2, 0), (7, 1001, 3, 1), (5, 49152, 2, 1), (17, 151_936, 5, 0)],
)
def test_apply_token_bitmask_kernel_matches_reference(
    dtype: torch.dtype, rows: int, vocab: int, slots: int, extra_words: int
) -> None:
    from wllm.kernels import apply_token_bitmask

    gen = torch.Generator().manual_seed(rows * vocab)
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-(2**31), 2**31 - 1, (slots, words), dtype=torch.int32, generator=gen)
    index = torch.randint(-1, slots, (rows,), dtype=torch.int32, generator=gen)
    # Rows of a wider buffer (a row stride past the vocabulary), as logits slices are.
    full = torch.randn(rows, vocab + 5, generator=gen).to(dtype)
    want = full[:, :vocab].clone()
    reference.apply_token_bitmask(want, bitmask, index)
    dev = full.cuda()
    got = dev[:, :vocab]
    apply_token_bitmask(got, bitmask.cuda(), index.cuda())
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    assert torch.equal(dev[:, vocab:].cpu(), full[:, vocab:])  # nothing past the vocabulary is touched
    # Without an index, row r uses mask r; fewer words than the vocabulary needs mask the rest.
    short = torch.randint(-(2**31), 2**31 - 1, (rows, max(1, words // 2)), dtype=torch.int32, generator=gen)
    want2 = full[:, :vocab].clone()
    reference.apply_token_bitmask(want2, short)
    got2 = full.cuda()[:, :vocab]
    apply_token_bitmask(got2, short.cuda())
    assert torch.equal(got2.cpu(), want2)


@pytest.mark.cuda
def test_grammar_rows_on_the_cuda_engine_follow_their_grammars(tmp_path_factory) -> None:
    """The real GPU path: masks uploaded and applied by the kernel in eager grammar steps, other rows in
    graphs and ahead; outputs as on the CPU kernel path."""
    from model_utils import VOCAB, tiny_hf_model

    from wllm.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from wllm.engine.llm_engine import LLMEngine
    from wllm.model.loader import load_model
    from wllm.model.tokenizer.synthetic import synthetic_tokenizer

    hf = tiny_hf_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    path = tmp_path_factory.mktemp("llama64-grammar")
    hf.save_pretrained(path)
    model = load_model(path, dtype="float32", device="cuda").model
    config = EngineConfig(
        cache=CacheConfig(block_size=8, num_gpu_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        async_scheduling=True,
    )
    engine = LLMEngine(model, synthetic_tokenizer(VOCAB), config)
    assert engine.worker.use_cuda_kernels
    prompts = [[5 + i, 40, 41 + i, 42] * (1 + i) for i in range(len(_workload()))]
    outs = _run(engine, prompts, _workload())
    _check_outputs(outs)
    assert engine.num_lookahead_steps > 0
