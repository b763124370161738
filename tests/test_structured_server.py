"""Structured output through `wllm serve` on the embedded SmolLM2-135M-Instruct, driven by the official
`openai` client: outputs parse and validate (`jsonschema`), streamed equals non-streamed, n > 1, the mask
leaves a conforming greedy answer unchanged, bad constraints are 400s, and a hostile schema does not stall a
concurrent stream."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from test_server_e2e import ServerProcess

from wllm.model.default_model import default_model_path

pytestmark = pytest.mark.slow

KEY = "sk-structured"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
    "additionalProperties": False,
}
ASK_PERSON = [
    {"role": "user", "content": "Describe a fictional person as JSON: name, age, height, job, address, skills."}
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model_path()
    s = ServerProcess(
        ["--api-key", KEY, "--max-model-len", "1024", "--kv-cache-memory", "0.25", "--grammar-timeout", "5"],
        tmp_path_factory.mktemp("structured") / "server.log",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=300)


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_validates_nested_objects_arrays_enums_bounds(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK_PERSON,
        temperature=0,
        max_tokens=200,
        response_format=schema_format(PERSON),
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_equals_non_streamed_and_n2_both_valid(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="SmolLM2-135M-Instruct", messages=ASK_PERSON, max_tokens=200, response_format=schema_format(PERSON)
    )
    whole = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    parts = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(temperature=0, stream=True, **kwargs)
        if c.choices
    ]
    assert "".join(parts) == whole
    r = client.chat.completions.create(temperature=1.0, seed=3, n=2, **kwargs)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_parses(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Return a JSON object with keys city and country for Paris."}],
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_choice_lark_gbnf_on_both_routes(client: openai.OpenAI) -> None:
    def chat(extra: dict, content: str, max_tokens: int = 40) -> str:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": content}],
            extra_body=extra,
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.content

    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", chat({"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}, "A phone number?"))
    assert chat({"guided_choice": ["positive", "negative"]}, "Sentiment of 'I love it'?") in ("positive", "negative")
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'
    assert re.fullmatch(r"The answer is [0-9]{1,4}\.", chat({"guided_grammar": lark}, "What is 12 + 30?"))
    gbnf = 'root ::= answer "!"\nanswer ::= "yes" | "no"'
    assert chat({"guided_grammar": gbnf}, "Is water wet?") in ("yes!", "no!")
    assert chat({"structured_outputs": {"choice": ["red", "blue"]}}, "Sky colour?") in ("red", "blue")
    # Text completions take the same fields.
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The year the war ended was",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_regex": r" [12][0-9]{3}"},
    )
    assert re.fullmatch(r" [12][0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="A JSON list of two colours:",
        max_tokens=60,
        temperature=0,
        extra_body={
            "guided_json": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 2}
        },
    )
    assert len(json.loads(r.choices[0].text)) == 2


def test_mask_leaves_a_conforming_greedy_answer_unchanged(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name one primary colour."}]
    free = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=12, logprobs=True
    )
    text = free.choices[0].message.content
    assert text
    for choices in ([text, "zzz other"], ["zzz other", text, text + " and more"]):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            temperature=0,
            max_tokens=12,
            logprobs=True,
            extra_body={"guided_choice": choices},
        )
        assert r.choices[0].message.content == text
        # Same tokens with the same (raw) logprobs: the mask changed nothing.
        got = [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content]
        want = [(t.token, round(t.logprob, 4)) for t in free.choices[0].logprobs.content]
        assert got == want[: len(got)] and "".join(t for t, _ in got) == text


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
        ({"guided_json": {"type": "strin"}}, "guided_json", "strin"),
        ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json", "no-such-format"),
        ({"guided_json": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}}, "guided_json", "oneOf"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
        ({"guided_grammar": 'root ::= ("a"'}, "guided_grammar", "GBNF"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
            "response_format",
            "must be an object",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "at most one"),
        ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "unknown field"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(
    client: openai.OpenAI, extra: dict, param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=5, messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    err = info.value.body
    assert err["param"] == param and fragment in err["message"], err


def _hostile(depth: int, keyword: str) -> dict:
    defs: dict = {"l0": {"type": "string", "maxLength": 4}}
    for i in range(1, depth + 1):
        ref = {"$ref": f"#/$defs/l{i - 1}"}
        defs[f"l{i}"] = {
            keyword: [
                ref,
                {"type": "object", "properties": {"x": ref, "y": ref}, "required": ["x"]},
                {"type": "array", "items": ref, "maxItems": 2},
            ]
        }
    return {"$defs": defs, "$ref": f"#/$defs/l{depth}"}


def test_hostile_schemas_do_not_stall_a_concurrent_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    # Seconds of compile work (8,000 patterned properties); compiled on the loop it would stall every stream.
    big = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+x{i}$"} for i in range(8000)
        },
        "required": ["p0"],
    }
    gaps: list[float] = []
    started = threading.Event()

    def stream() -> None:
        last = None
        s = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=150,
            stream=True,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Tell me a long story."}],
        )
        for _ in s:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    mark = len(gaps)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:  # nested oneOf, depth 16: refused at once
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=1,
            messages=ASK_PERSON,
            response_format=schema_format(_hostile(16, "oneOf")),
        )
    assert "oneOf" in info.value.body["message"]
    # The same nesting with anyOf compiles; the big schema compiles or is refused at the 5 s deadline.
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=1,
        messages=ASK_PERSON,
        response_format=schema_format(_hostile(16, "anyOf")),
    )
    assert r.choices[0].message.content.startswith(("{", "[", '"'))
    t1 = time.monotonic()
    try:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=1, messages=ASK_PERSON, response_format=schema_format(big)
        )
        assert r.choices[0].message.content.startswith("{")
    except openai.BadRequestError as exc:
        assert "limit of 5 s" in exc.body["message"]
    compile_time = time.monotonic() - t1
    assert time.monotonic() - t0 < 5 + 10 and compile_time < 5 + 5
    t.join()
    during = gaps[mark:]
    assert len(during) > 3
    # Compiling ran beside the engine, not on its loop or the event loop: no gap of the stream comes near the
    # time the big schema took.
    assert max(during) < max(1.5, compile_time / 2), (compile_time, sorted(during)[-3:])


def test_readme_json_schema_example_runs_verbatim(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "json_schema" in b)
    root = server.base_url.removesuffix("/v1")
    code = block.replace("http://127.0.0.1:8000", root).replace('api_key="unused"', f'api_key="{KEY}"')
    assert "127.0.0.1:8000" not in code and KEY in code  # only the addresses and the keys differ
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    last = capsys.readouterr().out.strip().splitlines()[-1]
    jsonschema.validate(json.loads(last), namespace["schema"])


def test_engine_process_compiles_in_the_child_and_refuses_there() -> None:
    """With the engine in its own process the child compiles each grammar again, off its loop; a grammar
    that reaches it without the server's check is refused there with the same ValueError (a 400)."""
    import asyncio

    from model_utils import stream_outputs

    from wllm.engine.async_engine import AsyncEngine
    from wllm.engine.engine_process import EngineProcess
    from wllm.sampling_params import SamplingParams
    from wllm.structured import grammars

    kwargs = {"device": "cpu", "max_model_len": 256, "kv_cache_memory": 64 << 20, "max_num_batched_tokens": 256}
    engine = AsyncEngine(EngineProcess(str(default_model_path()), kwargs))
    engine.start()
    try:
        tok = engine.tokenizer
        prompt = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "Pick a colour."}]), add_special_tokens=False
        )

        async def main() -> None:
            good = SamplingParams(temperature=0, max_tokens=10, grammar=grammars.choice_grammar(["red", "blue"]))
            outs = await stream_outputs(engine, prompt, good, "good")
            assert outs[-1].outputs[0].text in ("red", "blue") and outs[-1].outputs[0].finish_reason == "stop"
            with pytest.raises(ValueError, match="unclosed group"):
                await stream_outputs(engine, prompt, SamplingParams(grammar=grammars.regex_grammar("(x")), "bad")
            after = await stream_outputs(engine, prompt, SamplingParams(temperature=0, max_tokens=3), "after")
            assert after[-1].finished

        asyncio.run(main())
        assert engine.is_healthy()
    finally:
        engine.shutdown(close_engine=True)
