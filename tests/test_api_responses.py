"""POST /v1/responses on the scripted engine: the wire format and event sequence, the translation onto the
chat path (request mapping, recorded tool-call and reasoning outputs, tool round trips), the store and
`previous_response_id`, bad input, and the official `openai` client's `responses.create`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import openai
import pytest
from chat_recordings import TEXT_COMPLETION, TOOL_CALL_CHUNKS, TOOL_CALL_COMPLETION, WEATHER_ARGS
from fake_engine import ScriptedEngine
from litestar.testing import TestClient
from tool_templates import QWEN3_TEMPLATE, TemplateTokenizer

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.chat_view import view
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from wllm.entrypoints.openai.serving_responses import (
    ResponseBuilder,
    ResponseStore,
    build_response,
    parse_input,
    to_chat_request,
)

REPLY = "Hello! I am a scripted reply."
# What a Qwen3 model writes: its template selects the hermes tool-call parser and the <think> reasoning parser.
HERMES_REPLY = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
# Qwen3's template renders that turn back, and the tool's output after it.
RENDERED_CALL = (
    '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ScriptedEngine())) as c:
        yield c


def qwen3(reply: str) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(max_model_len=8192, replies=(reply,))
    engine.tokenizer = TemplateTokenizer(QWEN3_TEMPLATE)
    return TestClient(create_app(engine)), engine


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) per server-sent event."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def req(**body: Any) -> ResponsesRequest:
    return msgspec.convert(body, ResponsesRequest)


def blank_response() -> ResponseObject:
    return ResponseObject(
        id="resp_1",
        created_at=0,
        status="in_progress",
        instructions=None,
        max_output_tokens=None,
        model="m",
        parallel_tool_calls=True,
        previous_response_id=None,
        store=False,
        temperature=None,
        text={"format": {"type": "text"}},
        tool_choice="auto",
        tools=[],
        top_p=None,
    )


# ---------------------------------------------------------------- the endpoint


def test_text_response_equals_chat_completion(client: TestClient) -> None:
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "temperature": 0,
        },
    ).json()
    r = client.post("/v1/responses", json={"input": "Hi", "instructions": "Be brief.", "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": REPLY, "annotations": [], "logprobs": []}]
    assert item["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    u = body["usage"]
    assert u["input_tokens"] == chat["usage"]["prompt_tokens"] and u["output_tokens"] == len(REPLY)
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert body["instructions"] == "Be brief." and body["incomplete_details"] is None


def test_unprefixed_route(client: TestClient) -> None:
    assert client.post("/responses", json={"input": "Hi"}).status_code == 200


def test_stream_event_sequence(client: TestClient) -> None:
    r = client.post("/v1/responses", json={"input": "Hi", "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert [e for e, d in evs] == [d["type"] for e, d in evs]  # the event line names the data's type
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    types = " ".join(e for e, _ in evs)
    documented = (
        "response.created response.in_progress response.output_item.added response.content_part.added "
        "(response.output_text.delta )+response.output_text.done response.content_part.done "
        "response.output_item.done response.completed"
    )
    assert re.fullmatch(documented, types), types
    deltas = "".join(d["delta"] for e, d in evs if e == "response.output_text.delta")
    done = {e: d for e, d in evs}
    assert deltas == REPLY == done["response.output_text.done"]["text"]
    final = done["response.completed"]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == REPLY
    assert final["usage"]["output_tokens"] == len(REPLY)
    assert done["response.created"]["response"]["status"] == "in_progress"
    added = done["response.output_item.added"]["item"]
    assert added["status"] == "in_progress" and added["content"] == [] and added["id"] == final["output"][0]["id"]


def test_length_stop_is_incomplete(client: TestClient) -> None:
    body = client.post("/v1/responses", json={"input": "Hi", "temperature": 0, "max_output_tokens": 5}).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == REPLY[:5] and body["output"][0]["status"] == "incomplete"
    r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 5, "stream": True})
    evs = events(r.text)
    assert evs[-1][0] == "response.incomplete"
    assert evs[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_input_items_reach_the_chat_template() -> None:
    engine = ScriptedEngine()
    with TestClient(create_app(engine)) as c:
        items = [
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": "next"},
        ]
        assert c.post("/v1/responses", json={"input": items}).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[-1][0])
    assert prompt == "<s><|developer|>Rules.\n<|user|>a\nb\n<|assistant|>ok\n<|user|>next\n<|assistant|>"


# ---------------------------------------------------------------- translation (unit)


def test_request_mapping_to_chat() -> None:
    r = req(
        input="Hi",
        instructions="sys",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
    )
    chat = to_chat_request(r, parse_input(r.input))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "sys"), ("user", "Hi")]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (7, 0.5, 0.9, False)
    assert msgspec.to_builtins(chat.tools) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": TOOLS[0]["parameters"],
                "strict": None,  # the typed struct's default
            },
        }
    ]
    assert msgspec.to_builtins(chat.tool_choice) == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert to_chat_request(
        req(input="x", text={"format": {"type": "json_object"}}), parse_input("x")
    ).response_format == {"type": "json_object"}


def test_recorded_tool_calls_and_reasoning_become_output_items() -> None:
    response = build_response(ResponseBuilder(blank_response()), view(TOOL_CALL_COMPLETION))
    out = msgspec.to_builtins(response)["output"]
    assert out[0]["type"] == "reasoning"
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "The user wants the weather and the time."}]
    assert [(o["type"], o["call_id"], o["name"], o["arguments"], o["status"]) for o in out[1:]] == [
        ("function_call", "call_w1", "get_weather", WEATHER_ARGS, "completed"),
        ("function_call", "call_t2", "get_time", "{}", "completed"),
    ]
    assert response.status == "completed"
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 64


def test_recorded_tool_call_stream_events() -> None:
    builder = ResponseBuilder(blank_response())
    evs = [msgspec.to_builtins(e) for e in builder.start()]
    usage = None
    for raw in TOOL_CALL_CHUNKS:
        v = view(raw)
        usage = v.usage or usage
        for choice in v.choices:
            evs += [msgspec.to_builtins(e) for e in builder.feed(choice.delta)]
    evs += [msgspec.to_builtins(e) for e in builder.finish("tool_calls", usage)]
    types = [e["type"] for e in evs]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    item = "response.output_item.added"
    assert types == [
        "response.created",
        "response.in_progress",
        item,
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        item,
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        item,
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        item,
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    calls = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert [(c["name"], c["arguments"], c["output_index"]) for c in calls] == [
        ("get_weather", WEATHER_ARGS, 2),
        ("get_time", "{}", 3),
    ]
    added = [e["item"] for e in evs if e["type"] == item]
    assert added[2] == {
        "type": "function_call",
        "id": added[2]["id"],
        "call_id": "call_w1",
        "name": "get_weather",
        "arguments": "",
        "status": "in_progress",
    }
    final = evs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][2]["arguments"] == WEATHER_ARGS and final["usage"]["output_tokens"] == 30


def test_tool_round_trip_through_the_translation() -> None:
    """Turn 1's recorded tool calls go back as input with their outputs; turn 2's text comes out."""
    first = build_response(ResponseBuilder(blank_response()), view(TOOL_CALL_COMPLETION))
    items = [
        {"role": "user", "content": "Weather and time in Paris?"},
        *msgspec.to_builtins(first.output),
        {"type": "function_call_output", "call_id": "call_w1", "output": "22 C"},
        {"type": "function_call_output", "call_id": "call_t2", "output": [{"type": "input_text", "text": "9:00"}]},
    ]
    r = req(input=items, tools=TOOLS)
    chat = to_chat_request(r, parse_input(r.input))
    user, assistant, tool1, tool2 = chat.messages
    assert user.role == "user" and assistant.role == "assistant" and assistant.content is None
    assert assistant.reasoning_content == "The user wants the weather and the time."
    assert msgspec.to_builtins(assistant.tool_calls) == [
        {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
        {"id": "call_t2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert (tool1.role, tool1.tool_call_id, tool1.content) == ("tool", "call_w1", "22 C")
    assert (tool2.tool_call_id, tool2.content) == ("call_t2", "9:00")
    second = build_response(ResponseBuilder(blank_response()), view(TEXT_COMPLETION))
    assert msgspec.to_builtins(second.output)[0]["content"][0]["text"] == "It is 22 C in Paris."


def test_message_then_function_call_is_one_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
    ]
    chat = to_chat_request(req(input=items), parse_input(items))
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls[0].id == "c1" and chat.messages[1].content[0].text == "t"


def test_store_is_bounded() -> None:
    store = ResponseStore(max_responses=2)
    for i in range(3):
        r = blank_response()
        r.id = f"resp_{i}"
        store.put("k", r, [])
    assert len(store) == 2 and store.get("k", "resp_0") is None and store.get("k", "resp_2") is not None
    assert store.get("other-key", "resp_2") is None
    tiny = ResponseStore(max_bytes=100)
    tiny.put("k", blank_response(), [])
    assert len(tiny) == 0


# ---------------------------------------------------------------- tools through the chat path


def test_tools_reach_the_chat_path() -> None:
    """Each tool_choice reaches the chat path's tool plan: the character tokenizer has no template, so the
    generic format describes the tools in a system message, and required / named set a tool grammar
    (enforced once the engine applies `SamplingParams.grammar`)."""
    engine = ScriptedEngine(max_model_len=4096)
    named = {"type": "function", "name": "get_weather"}
    with TestClient(create_app(engine)) as c:
        for choice, says in (
            ("auto", "If no function is needed"),
            ("required", "You must call a function now."),
            (named, "Call the function get_weather now."),
        ):
            r = c.post("/v1/responses", json={"input": "Weather?", "tools": TOOLS, "tool_choice": choice})
            assert r.status_code == 200, r.text
            assert r.json()["tools"] == TOOLS and r.json()["tool_choice"] == choice
            prompt_ids, params = engine.calls[-1][:2]
            assert '"name": "get_weather"' in engine.tokenizer.decode(prompt_ids)
            assert says in engine.tokenizer.decode(prompt_ids)
            if choice != "auto":
                assert params.grammar is not None and "get_weather" in params.grammar
        r = c.post("/v1/responses", json={"input": "Weather?", "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200 and engine.calls[-1][1].grammar is None
        assert "get_weather" not in engine.tokenizer.decode(engine.calls[-1][0])
        r = c.post("/v1/responses", json={"input": "x", "tool_choice": named, "tools": [{**TOOLS[0], "name": "f"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        # JSON output is the chat path's response_format: this scripted model's character tokenizer cannot be
        # masked, so it is the chat path's 400, under this API's field names.
        r = c.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "json_object"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
        assert "structured output needs" in r.json()["error"]["message"]


def test_function_call_round_trip_through_the_chat_parser() -> None:
    """The model's Hermes-format reply is parsed by the chat path into reasoning, message and function_call
    items, whole and streamed (arguments in fragments); the call's output goes back as input (whole, or
    after previous_response_id) and renders into the next prompt with the call."""
    client, engine = qwen3(HERMES_REPLY)
    body = {"input": "Weather in Paris?", "tools": TOOLS, "temperature": 0}
    with client:
        first = client.post("/v1/responses", json=body).json()
        assert first["status"] == "completed" and first["incomplete_details"] is None
        reasoning, message, call = first["output"]
        assert reasoning["type"] == "reasoning"
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
        assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
        assert (call["type"], call["name"], call["arguments"], call["status"]) == (
            "function_call",
            "get_weather",
            WEATHER_ARGS,
            "completed",
        )
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
        assert first["usage"]["output_tokens"] == len(HERMES_REPLY)

        evs = events(client.post("/v1/responses", json={**body, "stream": True}).text)
        deltas = [d["delta"] for e, d in evs if e == "response.function_call_arguments.delta"]
        assert len(deltas) > 1 and "".join(deltas) == WEATHER_ARGS  # the model's text, in pieces
        [done] = [d for e, d in evs if e == "response.function_call_arguments.done"]
        assert (done["name"], done["arguments"], done["output_index"]) == ("get_weather", WEATHER_ARGS, 2)
        added = [d["item"] for e, d in evs if e == "response.output_item.added"]
        assert [a["type"] for a in added] == ["reasoning", "message", "function_call"]
        assert added[2]["name"] == "get_weather" and added[2]["arguments"] == ""
        assert not any("tool_call" in d.get("delta", "") for e, d in evs if e == "response.output_text.delta")
        assert evs[-1][0] == "response.completed"
        assert without_ids(evs[-1][1]["response"]["output"]) == without_ids(first["output"])

        engine.replies = ["It is 22 C in Paris."]
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "22 C"}
        items = [{"role": "user", "content": "Weather in Paris?"}, *first["output"], result]
        second = client.post("/v1/responses", json={"input": items, "tools": TOOLS, "temperature": 0}).json()
        prompt = engine.tokenizer.decode(engine.calls[-1][0])
        assert prompt.endswith(RENDERED_CALL), prompt
        assert second["status"] == "completed" and [o["type"] for o in second["output"]] == ["message"]
        assert second["output"][0]["content"][0]["text"] == "It is 22 C in Paris."
        # the same turn after previous_response_id: the stored conversation holds the call
        chained = client.post(
            "/v1/responses",
            json={"previous_response_id": first["id"], "input": [result], "tools": TOOLS, "temperature": 0},
        )
        assert chained.status_code == 200, chained.text
        assert engine.tokenizer.decode(engine.calls[-1][0]) == prompt


def test_truncated_function_call_is_incomplete() -> None:
    head = HERMES_REPLY[: HERMES_REPLY.index('{"city"')]
    client, _ = qwen3(HERMES_REPLY)
    with client:
        body = {"input": "Weather?", "tools": TOOLS, "temperature": 0, "max_output_tokens": len(head) + 5}
        r = client.post("/v1/responses", json=body).json()
        assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
        assert r["output"][-1]["type"] == "function_call" and r["output"][-1]["arguments"] == '{"cit'
        assert r["output"][-1]["status"] == "incomplete"


def test_openai_client_reads_function_calls() -> None:
    client, engine = qwen3(HERMES_REPLY)
    with client as c:
        oai = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", http_client=c, max_retries=0)
        r = oai.responses.create(model="default", input="Weather in Paris?", tools=TOOLS, temperature=0)
        [call] = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        with oai.responses.stream(model="default", input="Weather in Paris?", tools=TOOLS, temperature=0) as s:
            args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
            final = s.get_final_response()
        assert args == WEATHER_ARGS and [o.type for o in final.output][-1] == "function_call"
        engine.replies = ["It is 22 C in Paris."]
        done = oai.responses.create(
            model="default",
            tools=TOOLS,
            temperature=0,
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                *r.output,
                {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"},
            ],
        )
        assert done.output_text == "It is 22 C in Paris."


# ---------------------------------------------------------------- store and previous_response_id


def test_store_get_delete_and_previous_response_id() -> None:
    engine = ScriptedEngine()
    with TestClient(create_app(engine, ServerConfig(api_keys=["ka", "kb"]))) as c:
        a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
        first = c.post("/v1/responses", json={"input": "Hi", "temperature": 0}, headers=a).json()
        got = c.get(f"/v1/responses/{first['id']}", headers=a)
        assert got.status_code == 200 and got.json() == first
        assert c.get(f"/v1/responses/{first['id']}", headers=b).status_code == 404  # another key's
        second = c.post(
            "/v1/responses",
            json={"input": "More", "previous_response_id": first["id"], "instructions": "New rules."},
            headers=a,
        )
        assert second.status_code == 200 and second.json()["previous_response_id"] == first["id"]
        prompt = engine.tokenizer.decode(engine.calls[-1][0])
        assert prompt == f"<s><|system|>New rules.\n<|user|>Hi\n<|assistant|>{REPLY}\n<|user|>More\n<|assistant|>"
        # a chain of three: the stored conversation includes the first turn
        c.post("/v1/responses", json={"input": "Again", "previous_response_id": second.json()["id"]}, headers=a)
        assert engine.tokenizer.decode(engine.calls[-1][0]).count("<|user|>") == 3
        r = c.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]}, headers=b)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert c.delete(f"/v1/responses/{first['id']}", headers=a).json() == {
            "id": first["id"],
            "object": "response",
            "deleted": True,
        }
        assert c.get(f"/v1/responses/{first['id']}", headers=a).status_code == 404
        unstored = c.post("/v1/responses", json={"input": "Hi", "store": False}, headers=a).json()
        assert unstored["store"] is False
        assert c.get(f"/v1/responses/{unstored['id']}", headers=a).json()["error"]["code"] == "not_found"
        streamed = c.post("/v1/responses", json={"input": "Hi", "stream": True}, headers=a)
        final = events(streamed.text)[-1][1]["response"]
        assert c.get(f"/v1/responses/{final['id']}", headers=a).json()["output"] == final["output"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": "x", "foo": 1}, "foo", "unknown field"),
        ({}, None, "missing required field `input`"),
        ({"input": 5}, "input", "Expected"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens", "Expected `int | null`"),
        ({"input": "x", "temperature": 3}, "temperature", "temperature"),
        ({"input": []}, "input", "at least one item"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "input_image",
        ),
        ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "input[0].bogus", "unknown field"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]", "missing required field"),
        ({"input": [{"type": "reasoning", "encrypted_content": "zz"}]}, "input[0].encrypted_content", "encrypt"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0]", "name"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "not supported"),
        # the chat path's tool checks, in this API's names
        ({"input": "x", "tools": [{**TOOLS[0], "name": "a b"}]}, "tools[0].name", "tools[0].name 'a b' is not"),
        ({"input": "x", "tools": [{**TOOLS[0], "parameters": {"type": "string"}}]}, "tools[0].parameters", "object"),
        ({"input": "x", "tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name", "two tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "'g'"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "not supported"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
        ({"input": "x", "truncation": "auto"}, "truncation", "never"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format", "name"),
        ({"input": "x", "model": "gpt-5"}, "model", "does not exist"),
    ],
)
def test_bad_input_is_a_4xx_openai_error(
    client: TestClient, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    r = client.post("/v1/responses", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_context_overflow_names_the_fields() -> None:
    with TestClient(create_app(ScriptedEngine(max_model_len=64))) as c:
        r = c.post("/v1/responses", json={"input": "x" * 100})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "input"


# ---------------------------------------------------------------- the official client


def test_openai_client_responses_create_and_stream() -> None:
    with TestClient(create_app(ScriptedEngine(), ServerConfig(api_keys=["k1"]))) as c:
        oai = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="k1", http_client=c, max_retries=0)
        r = oai.responses.create(model="default", input="Hi", instructions="Be brief.", temperature=0)
        assert r.output_text == REPLY and r.status == "completed" and r.usage.output_tokens == len(REPLY)
        stream = oai.responses.create(model="default", input="Hi", instructions="Be brief.", temperature=0, stream=True)
        seen = [e.type for e in stream]
        assert seen[0] == "response.created" and seen[-1] == "response.completed"
        with oai.responses.stream(model="default", input="Hi", temperature=0) as s:
            text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
            assert text == REPLY == s.get_final_response().output_text
        assert oai.responses.retrieve(r.id).output_text == REPLY
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model="default", input="Hi", reasoning={"effort": "high"})
        assert info.value.body["param"] == "reasoning.effort"
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve("resp_missing")
