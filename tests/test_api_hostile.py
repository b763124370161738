"""Hostile request bodies (issue 32, items 1 and 5): each one a 400 with an OpenAI error body.

Deep nesting (bounded before decoding, never a RecursionError), unknown fields, fields declared but not
implemented, wrong types for every scalar field (no string-to-number coercion), and the valid OpenAI
message shapes that must render through a real chat template.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fake_engine import CharTokenizer, ScriptedEngine
from litestar.testing import TestClient

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.decoding import MAX_JSON_DEPTH, MAX_JSON_VALUES, json_bounds_exceeded, json_depth_exceeds
from wllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from wllm.model.tokenizer.chat_template import render_chat_template

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
MSGS = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": MSGS, "max_tokens": 3},
    COMPLETIONS: {"model": "tiny", "prompt": "hi", "max_tokens": 3},
    TOKENIZE: {"prompt": "hi"},
    DETOKENIZE: {"tokens": [104, 105]},
}
STRUCTS = {CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest, TOKENIZE: TokenizeRequest,
           DETOKENIZE: DetokenizeRequest}
PATHS = sorted(VALID)

# SmolLM2's template, which concatenates message['content'] unconditionally (the issue's Jinja error).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateTokenizer(CharTokenizer):
    """The character tokenizer with a real (sandboxed Jinja) chat template."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return render_chat_template(SMOLLM2_TEMPLATE, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    engine = ScriptedEngine(max_model_len=4096)
    engine.tokenizer = TemplateTokenizer()
    app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as c:
        yield c


def assert_400(r: Any, param: str | None = None, fragment: str | None = None, case: str = "") -> dict[str, Any]:
    assert r.status_code == 400, f"{case}: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, case
    assert err["type"] == "invalid_request_error" and err["message"], case
    if param is not None:
        assert err["param"] == param, (case, err)
    if fragment is not None:
        assert fragment in err["message"], (case, err)
    return err


def post_raw(client: TestClient, path: str, raw: bytes) -> Any:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# ------------------------------------------------------------------ item 1: nesting


def nested_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 973, 5000, 100_000])
def test_deep_nesting_is_400(client: TestClient, path: str, depth: int) -> None:
    bodies = {
        "array value": '{"x": ' + nested_array(depth) + "}",
        "object value": '{"x": ' + nested_object(depth) + "}",
        "bare array": nested_array(depth),
        "unclosed": "[" * depth,
        "in messages": '{"model": "tiny", "messages": [{"role": "user", "content": ' + nested_array(depth) + "}]}",
        "in a field": '{"model": "tiny", "prompt": "hi", "stop": ' + nested_object(depth) + "}",
    }
    for case, body in bodies.items():
        err = assert_400(post_raw(client, path, body.encode()), case=f"{path} {case} depth {depth}")
        assert err["message"] == (f"Invalid request: the request body nests deeper than {MAX_JSON_DEPTH} "
                                  "levels of arrays and objects"), case
        assert err["code"] == "nesting_too_deep"


@pytest.mark.parametrize("path", PATHS)
def test_nesting_at_the_limit_is_not_refused_for_depth(client: TestClient, path: str) -> None:
    # Exactly MAX_JSON_DEPTH levels (the body object is one): an ordinary validation error, not "too deep".
    body = '{"x": ' + nested_array(MAX_JSON_DEPTH - 1) + "}"
    err = assert_400(post_raw(client, path, body.encode()), case=path)
    assert "nests deeper" not in err["message"]


def test_brackets_inside_strings_do_not_count(client: TestClient) -> None:
    text = "[" * 1000 + '\\"{' * 300 + "]" * 10
    r = client.post(CHAT, json={**VALID[CHAT], "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    r = client.post(TOKENIZE, json={"prompt": text})
    assert r.status_code == 200 and r.json()["count"] == len(text) + 1


def _reference_depth(body: bytes) -> tuple[int, bool]:
    """Max depth the way a JSON parser sees it, and whether it stopped at a stray backslash."""
    depth = deepest = 0
    inside = escaped = False
    for c in body.decode("latin-1"):
        if inside:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                inside = False
        elif c == "\\":
            return deepest, True  # a parser fails here; the depth after it never matters
        elif c == '"':
            inside = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest, False


def _reference_commas(body: bytes) -> int:
    """Commas outside strings, the way a JSON parser sees them (up to a stray backslash)."""
    commas, inside, escaped = 0, False, False
    for c in body.decode("latin-1"):
        if inside:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                inside = False
        elif c == "\\":
            return commas
        elif c == '"':
            inside = True
        elif c == ",":
            commas += 1
    return commas


def test_depth_scan_matches_a_reference_parser() -> None:
    rng = random.Random(32)
    for _ in range(5000):
        body = bytes(rng.choice(b'[]{}"\\\\a,') for _ in range(rng.randint(0, 60)))
        limit = rng.randint(0, 6)
        deepest, stray = _reference_depth(body)
        got = json_depth_exceeds(body, limit)
        # The same scan cut into pieces of a few bytes (it carries its state across them) and told to
        # count commas too.
        chunk = rng.randint(1, 9)
        pieces = json_bounds_exceeded(body, limit, None, chunk=chunk) == "depth"
        if stray:
            assert got or deepest <= limit, (body, limit)  # never lets a deeper prefix through
            assert pieces or deepest <= limit, (body, limit, chunk)
        else:
            assert got == (deepest > limit) == pieces, (body, limit, chunk)
            commas = _reference_commas(body)
            values = rng.randint(0, 8)
            verdict = json_bounds_exceeded(body, 10**6, values, chunk=chunk)
            assert (verdict == "values") == (commas > values), (body, values, chunk)


@pytest.mark.parametrize("path", PATHS)
def test_too_many_json_values_is_400(client: TestClient, path: str) -> None:
    # A million small values would hold the GIL for a long decode; refused before it starts.
    body = b'{"model": "tiny", "prompt": [' + b"7," * MAX_JSON_VALUES + b"7]}"
    err = assert_400(post_raw(client, path, body), case=path)
    assert err["code"] == "too_many_values" and str(MAX_JSON_VALUES) in err["message"]
    at_limit = b'{"x": [' + b"7," * MAX_JSON_VALUES + b"7]}"  # exactly the limit: not refused for its size
    assert_400(post_raw(client, path, at_limit), fragment="unknown field", case=path)


# ------------------------------------------------------------------ item 5: unknown and unsupported fields


@pytest.mark.parametrize("path", PATHS)
def test_unknown_top_level_field_is_400_naming_it(client: TestClient, path: str) -> None:
    for field in ("unknown_field", "temperatur", "reasoning_effort", "modalities", "beam_width"):
        err = assert_400(client.post(path, json={**VALID[path], field: 1}), param=field, case=f"{path} {field}")
        assert f"unknown field `{field}`" in err["message"] and err["code"] == "unknown_field"


def test_unknown_nested_fields_are_400_naming_them(client: TestClient) -> None:
    cases = [
        ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
         "messages[0].content[0].x"),
        ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ]
    for body, param in cases:
        err = assert_400(client.post(CHAT, json={**VALID[CHAT], **body}), param=param, case=param)
        assert f"unknown field `{param}`" in err["message"]
    err = assert_400(client.post(TOKENIZE, json={"messages": [{"role": "user", "content": "hi", "x": 1}]}),
                     param="messages[0].x")


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}

UNSUPPORTED: list[tuple[str, dict[str, Any], str, str]] = [
    (CHAT, {"best_of": 2}, "best_of", "with use_beam_search only"),
    (COMPLETIONS, {"best_of": 2}, "best_of", "with use_beam_search only"),
    (COMPLETIONS, {"n": 2, "best_of": 3}, "best_of", "with use_beam_search only"),
    (CHAT, {"length_penalty": 0.5}, "length_penalty", "beam search only"),
    (COMPLETIONS, {"early_stopping": True}, "early_stopping", "beam search only"),
    (CHAT, {"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", "between n (3) and 16"),
    (COMPLETIONS, {"use_beam_search": True, "best_of": 0}, "best_of", "between n (1) and 16"),
    (COMPLETIONS, {"use_beam_search": True, "n": 0}, "n", "between 1 and 16"),
    (COMPLETIONS, {"use_beam_search": True, "n": 17}, "n", "between 1 and 16"),
    (CHAT, {"use_beam_search": True, "temperature": 0.7}, "temperature", "must be 0 with beam search"),
    (CHAT, {"use_beam_search": True, "top_p": 0.5}, "top_p", "not supported with beam search"),
    (CHAT, {"use_beam_search": True, "logprobs": True}, "logprobs", "not supported with beam search"),
    (COMPLETIONS, {"use_beam_search": True, "stop": ["x"]}, "stop", "not supported with beam search"),
    (COMPLETIONS, {"use_beam_search": True, "presence_penalty": 1.0}, "presence_penalty", "not supported with beam"),
    (COMPLETIONS, {"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping", "Invalid enum value"),
    (COMPLETIONS, {"suffix": "end"}, "suffix", "not supported"),
    (CHAT, {"functions": [TOOL["function"]]}, "functions", "not supported"),
    (CHAT, {"function_call": "auto"}, "function_call", "not supported"),
    (CHAT, {"function_call": {"name": "get_weather"}}, "function_call", "not supported"),
    (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "not in tools"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"tool_choice": "sometimes"}, "tool_choice", "Invalid enum value"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "needs a `schema`"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", "not supported"),
    (COMPLETIONS, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "refusal": "no"}]}, "messages[0].refusal",
     "not supported"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "image_url"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "image_url"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content", "needs `text`"),
    (TOKENIZE, {"prompt": None, "messages": MSGS, "add_special_tokens": False}, "add_special_tokens", "prompt"),
    (TOKENIZE, {"add_generation_prompt": False}, "add_generation_prompt", "messages"),
]


@pytest.mark.parametrize(("path", "body", "param", "fragment"), UNSUPPORTED,
                         ids=[f"{p}-{param}-{i}" for i, (p, _, param, _) in enumerate(UNSUPPORTED)])
def test_unsupported_field_is_400_naming_it(client: TestClient, path: str, body: dict[str, Any], param: str,
                                           fragment: str) -> None:
    payload = {k: v for k, v in {**VALID[path], **body}.items() if v is not None or k != "prompt"}
    assert_400(client.post(path, json=payload), param=param, fragment=fragment, case=str(body))


def test_supported_values_of_those_fields_still_work(client: TestClient) -> None:
    ok = [
        (CHAT, {"use_beam_search": False, "best_of": 1, "user": "u1", "parallel_tool_calls": False}),
        (CHAT, {"tools": [TOOL], "tool_choice": "auto"}),
        (CHAT, {"tools": [TOOL], "tool_choice": "none"}),
        (CHAT, {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
        (CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        (CHAT, {"response_format": {"type": "text"}, "stream_options": {"include_usage": True}, "stream": True}),
        (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "bob", "refusal": None,
                              "function_call": None}]}),
        (COMPLETIONS, {"n": 2, "best_of": 2, "suffix": "", "user": "u1", "use_beam_search": False}),
        (TOKENIZE, {"prompt": "hi", "add_special_tokens": False}),
        (TOKENIZE, {"prompt": None, "messages": MSGS, "add_generation_prompt": False}),
    ]
    for path, body in ok:
        payload = {k: v for k, v in {**VALID[path], **body}.items() if v is not None}
        r = client.post(path, json=payload)
        assert r.status_code == 200, (body, r.text)


# ------------------------------------------------------------------ item 5: strict types


def _scalar_fields(struct: type) -> list[tuple[str, str]]:
    """(field, kind) for every bool/int/float/str field, from the Struct's own annotations."""
    out = []
    for f in msgspec.structs.fields(struct):
        t = msgspec.inspect.type_info(f.type)
        kinds = {type(x).__name__ for x in (t.types if isinstance(t, msgspec.inspect.UnionType) else [t])}
        kinds -= {"NoneType"}
        if len(kinds) == 1 and (kind := kinds.pop()) in {"BoolType", "IntType", "FloatType", "StrType"}:
            out.append((f.name, kind))
    return out


WRONG: dict[str, list[Any]] = {
    "BoolType": ["true", 1, 0, "1"],
    "IntType": ["10", 10.5, 1.0, True, "x"],
    "FloatType": ["0.5", "1", True, "nan"],
    "StrType": [1, 1.5, True, ["a"], {"a": 1}],
}


@pytest.mark.parametrize("path", PATHS)
def test_wrong_type_for_every_scalar_field_is_400(client: TestClient, path: str) -> None:
    fields = _scalar_fields(STRUCTS[path])
    names = {name for name, _ in fields}
    # The fields the issue names are covered by this walk.
    if path in (CHAT, COMPLETIONS):
        assert {"max_tokens", "temperature", "stream", "n", "seed", "top_p", "user"} <= names
    for name, kind in fields:
        for value in WRONG[kind]:
            err = assert_400(client.post(path, json={**VALID[path], name: value}), param=name,
                             case=f"{path} {name}={value!r}")
            assert "Expected" in err["message"], err


def test_string_numbers_are_not_coerced(client: TestClient) -> None:
    err = assert_400(client.post(CHAT, json={**VALID[CHAT], "max_tokens": "10"}), param="max_tokens")
    assert err["message"] == "Invalid request: Expected `int | null`, got `str` - at `$.max_tokens`"
    assert_400(client.post(COMPLETIONS, json={**VALID[COMPLETIONS], "max_tokens": "10"}), param="max_tokens")
    assert_400(client.post(DETOKENIZE, json={"tokens": ["104"]}), param="tokens[0]")
    assert_400(client.post(DETOKENIZE, json={"tokens": [104.0]}), param="tokens[0]")
    assert_400(client.post(COMPLETIONS, json={**VALID[COMPLETIONS], "prompt": [1, "2"]}), param="prompt")
    assert_400(client.post(CHAT, json={**VALID[CHAT], "messages": [{"role": "user", "content": 5}]}),
               param="messages[0].content")
    assert_400(client.post(CHAT, json={**VALID[CHAT], "logit_bias": {"5": "1"}}), param="logit_bias[...]")
    assert_400(client.post(CHAT, json={**VALID[CHAT], "stop_token_ids": ["5"]}), param="stop_token_ids[0]")
    # JSON numbers stay numbers: an integer is a fine float.
    assert client.post(CHAT, json={**VALID[CHAT], "temperature": 1, "top_p": 1}).status_code == 200


@pytest.mark.parametrize("path", PATHS)
def test_wrong_body_shapes_are_400(client: TestClient, path: str) -> None:
    for raw in (b"[]", b'"x"', b"1", b"null", b"{", b'{"model": "tiny",}', b"\xff"):
        assert_400(post_raw(client, path, raw), case=f"{path} {raw!r}")


# ------------------------------------------------------------------ valid message shapes render


def _rendered(client: TestClient, messages: list[dict[str, Any]]) -> str:
    r = client.post(TOKENIZE, json={"messages": messages})
    assert r.status_code == 200, r.text
    r = client.post(DETOKENIZE, json={"tokens": r.json()["tokens"]})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
]


def test_assistant_tool_calls_with_null_content_render(client: TestClient) -> None:
    text = _rendered(client, TOOL_HISTORY)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n21C<|im_end|>" in text
    assert "None" not in text
    without = [TOOL_HISTORY[0], {k: v for k, v in TOOL_HISTORY[1].items() if k != "content"}, TOOL_HISTORY[2]]
    assert _rendered(client, without) == text  # content left out is the same as null
    r = client.post(CHAT, json={**VALID[CHAT], "messages": TOOL_HISTORY, "tools": [TOOL]})
    assert r.status_code == 200, r.text


def test_content_parts_render(client: TestClient) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    text = _rendered(client, parts)
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\none\ntwo<|im_end|>" in text
    assert _rendered(client, [{"role": "user", "content": "one\ntwo"}]).endswith(text.split("<|im_end|>\n", 1)[1])
    r = client.post(CHAT, json={**VALID[CHAT], "messages": parts})
    assert r.status_code == 200, r.text


def test_null_content_renders_in_the_real_template_helper() -> None:
    out = render_chat_template(SMOLLM2_TEMPLATE, TOOL_HISTORY, add_generation_prompt=True)
    assert out.endswith("<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n21C<|im_end|>\n"
                        "<|im_start|>assistant\n")


# ------------------------------------------------------------------ item 2: prompt length


def test_prompts_over_max_prompt_chars_are_400_before_tokenizing() -> None:
    engine = ScriptedEngine(max_model_len=4096)
    engine.tokenizer = TemplateTokenizer()
    encoded: list[int] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, add_special_tokens=True: encoded.append(len(text)) or encode(  # type: ignore
        text, add_special_tokens)
    app = create_app(engine, ServerConfig(served_model_names=["tiny"], max_prompt_chars=1000))
    long = "x" * 1001
    with TestClient(app) as c:
        cases = [
            (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": long}]}, "messages"),
            (COMPLETIONS, {"model": "tiny", "prompt": long}, "prompt"),
            (COMPLETIONS, {"model": "tiny", "prompt": ["ok", long]}, "prompt"),
            (TOKENIZE, {"prompt": long}, "prompt"),
            (TOKENIZE, {"messages": [{"role": "user", "content": long}]}, "messages"),
        ]
        for path, body, param in cases:
            err = assert_400(c.post(path, json=body), param=param, fragment="--max-prompt-chars", case=path)
            assert err["code"] == "prompt_too_long"
        assert encoded == [], "a refused prompt was tokenized"
        assert c.post(COMPLETIONS, json={"model": "tiny", "prompt": "x" * 900, "max_tokens": 2}).status_code == 200


def test_default_prompt_limit_is_16_characters_per_token_of_context() -> None:
    app = create_app(ScriptedEngine(max_model_len=100), ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as c:
        err = assert_400(c.post(TOKENIZE, json={"prompt": "y" * 1601}), param="prompt")
        assert err["code"] == "prompt_too_long" and "at most 1600 characters" in err["message"]
        assert c.post(TOKENIZE, json={"prompt": "y" * 1600}).json()["count"] == 1601


def test_a_large_body_is_prepared_off_the_event_loop() -> None:
    """Above OFFLOAD_BODY_BYTES the decode, template and tokenizer run in the prep pool's threads."""
    import threading

    from wllm.entrypoints.openai.offload import OFFLOAD_BODY_BYTES

    engine = ScriptedEngine(max_model_len=1 << 20)
    threads: list[str] = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, add_special_tokens=True: threads.append(  # type: ignore
        threading.current_thread().name) or encode(text, add_special_tokens)
    app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as c:
        for size in (10, OFFLOAD_BODY_BYTES):
            r = c.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "z" * size}],
                                   "max_tokens": 2})
            assert r.status_code == 200
    small, big = threads
    assert not small.startswith("wllm-prep") and big.startswith("wllm-prep"), threads
