"""POST /v1/messages and /v1/messages/count_tokens on the scripted engine: Anthropic's message shape and
event stream, the translation onto the chat path (content blocks, tools, tool_choice, recorded tool-call
outputs, a tool round trip), Anthropic's error body for every refusal, x-api-key auth, and the official
`anthropic` client."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import msgspec
import pytest
from chat_recordings import TEXT_COMPLETION, TOOL_CALL_CHUNKS, TOOL_CALL_COMPLETION
from fake_engine import ScriptedEngine
from litestar.testing import TestClient
from test_api_responses import HERMES_REPLY, RENDERED_CALL, qwen3

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.chat_view import view
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.protocol_anthropic import MessageObject, MessagesRequest
from wllm.entrypoints.openai.serving_messages import (
    MessageBuilder,
    build_message,
    to_chat_request,
    usage_of,
)

REPLY = "Hello! I am a scripted reply."
HI = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ScriptedEngine())) as c:
        yield c


def post(client: TestClient, **body: Any) -> Any:
    body.setdefault("model", "default")
    body.setdefault("max_tokens", 100)
    body.setdefault("messages", HI)
    return client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def mreq(**body: Any) -> MessagesRequest:
    body.setdefault("model", "m")
    body.setdefault("max_tokens", 10)
    return msgspec.convert(body, MessagesRequest)


def builder(stops: list[str] | None = None) -> MessageBuilder:
    return MessageBuilder(MessageObject(id="msg_1", content=[], model="m", usage=usage_of(0, 0, 0)), stops or [])


# ---------------------------------------------------------------- the endpoint


def test_message_equals_chat_completion(client: TestClient) -> None:
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."}, *HI], "temperature": 0}
    ).json()
    r = post(client, system="Be brief.", temperature=0)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": REPLY, "citations": None}]
    assert m["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert m["stop_reason"] == "end_turn" and m["stop_sequence"] is None
    u = m["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["output_tokens"] == len(REPLY)
    assert client.post("/messages", json={"model": "default", "max_tokens": 5, "messages": HI}).status_code == 200


def test_stream_event_sequence(client: TestClient) -> None:
    r = post(client, temperature=0, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert all(e == d["type"] for e, d in evs)
    types = " ".join(e for e, _ in evs)
    documented = (
        "message_start content_block_start ping (content_block_delta )+content_block_stop message_delta message_stop"
    )
    assert re.fullmatch(documented, types), types
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert evs[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": "", "citations": None},
    }
    text = "".join(d["delta"]["text"] for e, d in evs if e == "content_block_delta")
    assert text == REPLY and all(d["delta"]["type"] == "text_delta" for e, d in evs if e == "content_block_delta")
    delta = dict(evs)["message_delta"]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(REPLY)


def test_stop_reasons(client: TestClient) -> None:
    m = post(client, temperature=0, max_tokens=5).json()
    assert m["stop_reason"] == "max_tokens" and m["content"][0]["text"] == REPLY[:5]
    m = post(client, temperature=0, stop_sequences=["scripted"]).json()
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "scripted")
    assert m["content"][0]["text"] == "Hello! I am a "
    evs = events(post(client, temperature=0, stop_sequences=["scripted"], stream=True).text)
    assert dict(evs)["message_delta"]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "scripted"}


def test_content_blocks_reach_the_chat_template() -> None:
    engine = ScriptedEngine()
    with TestClient(create_app(engine)) as c:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "b"},
                ],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next"},
        ]
        r = post(
            c,
            system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
            messages=messages,
            metadata={"user_id": "u1"},
        )
        assert r.status_code == 200, r.text
    assert engine.tokenizer.decode(engine.calls[-1][0]) == (
        "<s><|system|>S1\nS2\n<|user|>a\nb\n<|assistant|>ok\n<|user|>next\n<|assistant|>"
    )


@pytest.mark.parametrize("tool_choice", [None, {"type": "auto"}, {"type": "any"}, {"type": "none"}])
def test_count_tokens_matches_usage(tool_choice: dict[str, str] | None) -> None:
    """With tools the generic format adds a system message describing them (its text depends on tool_choice):
    count_tokens goes through the same tool plan, so it counts that message too."""
    body: dict[str, Any] = {"model": "default", "system": "Be brief.", "messages": HI, "tools": TOOLS}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    with TestClient(create_app(ScriptedEngine(max_model_len=4096))) as client:
        r = client.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200 and set(r.json()) == {"input_tokens"}
        u = post(client, **body).json()["usage"]
        assert r.json()["input_tokens"] == u["input_tokens"] + u["cache_read_input_tokens"]
        without_tools = client.post("/v1/messages/count_tokens", json={**body, "tools": None, "tool_choice": None})
        if tool_choice != {"type": "none"}:  # under none the generic format does not describe the tools
            assert without_tools.json()["input_tokens"] < r.json()["input_tokens"]
        r = client.post("/v1/messages/count_tokens", json={"model": "default", "messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error"
        # the chat path's tool checks hold here too, in Anthropic's shape
        r = client.post("/v1/messages/count_tokens", json={**body, "tool_choice": {"type": "tool", "name": "nope"}})
        assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


# ---------------------------------------------------------------- translation (unit)


def test_request_mapping_to_chat() -> None:
    chat = to_chat_request(
        mreq(
            system="sys",
            messages=HI,
            max_tokens=7,
            stop_sequences=["END"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            tools=TOOLS,
            metadata={"user_id": "u"},
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        )
    )
    assert chat.messages[0].content == "sys" and chat.messages[1].content[0].text == "Hi"
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.user) == (
        7,
        ["END"],
        0.5,
        0.9,
        40,
        "u",
    )
    assert msgspec.to_builtins(chat.tools) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOLS[0]["input_schema"],
                "description": "Weather in a city",
                "strict": None,  # the typed struct's default
            },
        }
    ]
    assert msgspec.to_builtins(chat.tool_choice) == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }
    for kind, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert to_chat_request(mreq(messages=HI, tool_choice={"type": kind})).tool_choice == expected


def test_recorded_tool_calls_become_tool_use_blocks() -> None:
    m = msgspec.to_builtins(build_message(builder(), view(TOOL_CALL_COMPLETION), cached=64))
    assert m["content"] == [
        {"type": "thinking", "thinking": "The user wants the weather and the time.", "signature": ""},
        {"type": "tool_use", "id": "call_w1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_t2", "name": "get_time", "input": {}},
    ]
    assert m["stop_reason"] == "tool_use"
    assert m["usage"] == {
        "input_tokens": 56,
        "output_tokens": 30,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
    }


def test_recorded_tool_call_stream_events() -> None:
    b = builder()
    evs = [msgspec.to_builtins(e) for e in b.start()]
    for raw in TOOL_CALL_CHUNKS:
        for choice in view(raw).choices:
            evs += [msgspec.to_builtins(e) for e in b.feed(choice.delta)]
    evs += [msgspec.to_builtins(e) for e in b.finish("tool_calls", None, usage_of(120, 0, 30))]
    assert [e["type"] for e in evs] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    starts = [e["content_block"] for e in evs if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "", "citations": None},
        {"type": "tool_use", "id": "call_w1", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "call_t2", "name": "get_time", "input": {}},
    ]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert deltas[0] == {"type": "thinking_delta", "thinking": "The user wants "}
    assert "".join(d["partial_json"] for d in deltas[3:5]) == '{"city": "Paris"}'
    assert all(d["type"] == "input_json_delta" for d in deltas[3:])
    assert evs[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert b.message.content[2].input == {"city": "Paris"}


def test_tool_round_trip_through_the_translation() -> None:
    first = msgspec.to_builtins(build_message(builder(), view(TOOL_CALL_COMPLETION), cached=0))
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": first["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_w1", "content": "22 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_t2",
                    "content": [{"type": "text", "text": "9:00"}],
                    "is_error": False,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    chat = to_chat_request(mreq(messages=messages, tools=TOOLS))
    user, assistant, tool1, tool2, after = chat.messages
    assert assistant.role == "assistant" and assistant.content is None
    assert assistant.reasoning_content == "The user wants the weather and the time."
    assert msgspec.to_builtins(assistant.tool_calls) == [
        {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_t2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert (tool1.role, tool1.tool_call_id, tool1.content) == ("tool", "call_w1", "22 C")
    assert (tool2.tool_call_id, tool2.content) == ("call_t2", "9:00")
    assert after.role == "user" and after.content[0].text == "Thanks"
    second = msgspec.to_builtins(build_message(builder(), view(TEXT_COMPLETION), cached=0))
    assert second["content"] == [{"type": "text", "text": "It is 22 C in Paris.", "citations": None}]
    assert second["stop_reason"] == "end_turn"


def test_tools_reach_the_chat_path() -> None:
    """Each tool_choice reaches the chat path's tool plan: the character tokenizer has no template, so the
    generic format describes the tools in a system message, and any / tool set a tool grammar (enforced
    once the engine applies `SamplingParams.grammar`)."""
    engine = ScriptedEngine(max_model_len=4096)
    with TestClient(create_app(engine)) as c:
        for choice, says in (
            ({"type": "auto"}, "If no function is needed"),
            ({"type": "any"}, "You must call a function now."),
            ({"type": "tool", "name": "get_weather"}, "Call the function get_weather now."),
        ):
            r = post(c, tools=TOOLS, tool_choice=choice)
            assert r.status_code == 200, r.text
            prompt_ids, params = engine.calls[-1][:2]
            assert '"name": "get_weather"' in engine.tokenizer.decode(prompt_ids)
            assert says in engine.tokenizer.decode(prompt_ids)
            if choice["type"] != "auto":
                assert params.grammar is not None and "get_weather" in params.grammar
        r = post(c, tools=TOOLS, tool_choice={"type": "none"})
        assert r.status_code == 200 and engine.calls[-1][1].grammar is None
        assert "get_weather" not in engine.tokenizer.decode(engine.calls[-1][0])
        r = post(c, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "get_time" in r.json()["error"]["message"]


def test_tool_use_round_trip_through_the_chat_parser() -> None:
    """The model's Hermes-format reply is parsed by the chat path into thinking, text and tool_use blocks,
    whole and streamed (input_json_delta fragments), stop_reason tool_use; the tool_result goes back and
    renders into the next prompt with the call."""
    client, engine = qwen3(HERMES_REPLY)
    with client:
        ask: dict[str, Any] = {"tools": TOOLS, "temperature": 0, "max_tokens": 200}
        ask["messages"] = [{"role": "user", "content": "Weather in Paris?"}]
        first = post(client, **ask).json()
        assert first["stop_reason"] == "tool_use" and first["stop_sequence"] is None
        thinking, text, use = first["content"]
        assert thinking == {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""}
        assert text == {"type": "text", "text": "Let me check.", "citations": None}
        assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather", {"city": "Paris"})

        r = post(client, **ask, stream=True)
        evs = events(r.text)
        starts = [d["content_block"] for e, d in evs if e == "content_block_start"]
        assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
        assert starts[2]["name"] == "get_weather" and starts[2]["input"] == {}
        parts = [d["delta"]["partial_json"] for e, d in evs if e == "content_block_delta" and d["index"] == 2]
        assert len(parts) > 1 and "".join(parts) == '{"city": "Paris"}'
        assert not any("tool_call" in d["delta"].get("text", "") for e, d in evs if e == "content_block_delta")
        [delta] = [d for e, d in evs if e == "message_delta"]
        assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
        assert [e for e, _ in evs][-3:] == ["content_block_stop", "message_delta", "message_stop"]

        engine.replies = ["It is 22 C in Paris."]
        history = [
            *ask["messages"],
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "22 C"}]},
        ]
        second = post(client, tools=TOOLS, temperature=0, max_tokens=200, messages=history).json()
        prompt = engine.tokenizer.decode(engine.calls[-1][0])
        assert prompt.endswith(RENDERED_CALL), prompt
        assert second["content"] == [{"type": "text", "text": "It is 22 C in Paris.", "citations": None}]
        assert second["stop_reason"] == "end_turn"


def test_truncated_tool_use_is_max_tokens_never_500() -> None:
    head = HERMES_REPLY[: HERMES_REPLY.index('{"city"')]
    client, _ = qwen3(HERMES_REPLY)
    with client:
        for stream in (False, True):
            r = post(client, tools=TOOLS, temperature=0, max_tokens=len(head) + 5, stream=stream)
            assert r.status_code == 200, r.text
            if stream:
                evs = events(r.text)
                assert "error" not in [e for e, _ in evs]
                [delta] = [d for e, d in evs if e == "message_delta"]
                assert delta["delta"]["stop_reason"] == "max_tokens"
            else:
                body = r.json()
                assert body["stop_reason"] == "max_tokens"
                assert body["content"][-1] == {"type": "tool_use", "id": body["content"][-1]["id"],
                                               "name": "get_weather", "input": {}}


def test_anthropic_client_reads_tool_use() -> None:
    client, engine = qwen3(HERMES_REPLY)
    greedy = {"extra_body": {"temperature": 0}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    async def main() -> None:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=client.app), base_url="http://wllm")
        claude = anthropic.AsyncAnthropic(base_url="http://wllm", api_key="none", http_client=http, max_retries=0)
        m = await claude.messages.create(model="default", max_tokens=200, messages=ask, tools=TOOLS, **greedy)
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        async with claude.messages.stream(model="default", max_tokens=200, messages=ask, tools=TOOLS, **greedy) as s:
            final = await s.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}
        engine.replies = ["It is 22 C in Paris."]
        done = await claude.messages.create(
            model="default",
            max_tokens=200,
            tools=TOOLS,
            messages=[
                *ask,
                {"role": "assistant", "content": m.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C"}]},
            ],
            **greedy,
        )
        assert done.content[0].type == "text" and done.content[0].text == "It is 22 C in Paris."

    asyncio.run(main())


# ---------------------------------------------------------------- errors and auth


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"foo": 1}, "unknown field `foo`"),
        ({"messages": []}, "at least one message"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
            "user turn cannot hold tool_use",
        ),
        ({"messages": [*HI, {"role": "assistant", "content": "prefill"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tools": [{"name": "x"}]}, "input_schema"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        # the chat path's tool checks, in this API's names
        ({"tools": [{**TOOLS[0], "name": "a b"}]}, "tools[0].name 'a b' is not a valid"),
        ({"tools": [{**TOOLS[0], "input_schema": {"type": "string"}}]}, "tools[0].input_schema must be"),
        ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "g"}}, "names the function 'g'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"temperature": 1.5}, "temperature must be in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"stop_sequences": ["s"] * 17}, "stop_sequences"),
        ({"model": "claude-sonnet-4"}, "does not exist"),
        ({"max_tokens": 10_000}, "maximum context length"),
    ],
)
def test_bad_input_is_a_4xx_anthropic_error(client: TestClient, body: dict[str, Any], fragment: str) -> None:
    base = {"model": "default", "max_tokens": 10, "messages": HI}
    base.update(body)
    r = client.post("/v1/messages", json={k: v for k, v in base.items() if v is not None})
    assert 400 <= r.status_code < 500, r.text
    j = r.json()
    assert j["type"] == "error" and set(j["error"]) == {"type", "message"}
    assert j["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")
    assert fragment in j["error"]["message"], j


def test_malformed_and_oversized_bodies_are_anthropic_errors() -> None:
    with TestClient(create_app(ScriptedEngine(), ServerConfig(max_body_bytes=1000))) as c:
        r = c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.post(
            "/v1/messages",
            json={"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 2000}]},
        )
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_wrong_method_is_an_anthropic_error(client: TestClient) -> None:
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "error" in client.get("/v1/chat/completions").json()  # OpenAI's routes keep OpenAI's shape
    assert client.get("/v1/chat/completions").json()["error"]["code"] == "method_not_allowed"


def test_x_api_key_and_bearer_auth() -> None:
    with TestClient(create_app(ScriptedEngine(), ServerConfig(api_keys=["sk-a"]))) as c:
        body = {"model": "default", "max_tokens": 5, "messages": HI}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and "x-api-key" in r.json()["error"]["message"]
        r = c.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "sk-a"}).status_code == 200
        assert c.post("/v1/messages", json=body, headers={"Authorization": "Bearer sk-a"}).status_code == 200
        r = c.post("/v1/messages/count_tokens", json={"model": "default", "messages": HI})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # the OpenAI routes keep OpenAI's shape
        assert "error" in c.post("/v1/responses", json={"input": "x"}).json()


def test_rate_limit_is_an_anthropic_429() -> None:
    with TestClient(create_app(ScriptedEngine(), ServerConfig(rate_limit_rpm=1))) as c:
        body = {"model": "default", "max_tokens": 5, "messages": HI}
        assert c.post("/v1/messages", json=body).status_code == 200
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"]


def test_dead_engine_is_an_overloaded_error() -> None:
    engine = ScriptedEngine()
    with TestClient(create_app(engine)) as c:
        engine.healthy = False
        r = post(c)
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


# ---------------------------------------------------------------- the official client


def test_anthropic_client_create_stream_and_count_tokens() -> None:
    app = create_app(ScriptedEngine(), ServerConfig(api_keys=["sk-a"]))
    greedy = {"extra_body": {"temperature": 0}}  # this SDK no longer sends sampling fields itself

    async def main() -> None:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://wllm")
        client = anthropic.AsyncAnthropic(base_url="http://wllm", api_key="sk-a", http_client=http, max_retries=0)
        m = await client.messages.create(model="default", max_tokens=100, system="Be brief.", messages=HI, **greedy)
        assert m.content[0].text == REPLY and m.stop_reason == "end_turn" and m.usage.output_tokens == len(REPLY)
        stream = await client.messages.create(model="default", max_tokens=100, messages=HI, stream=True, **greedy)
        kinds = [e.type async for e in stream]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        async with client.messages.stream(model="default", max_tokens=100, messages=HI, **greedy) as s:
            assert await s.get_final_text() == REPLY
            assert (await s.get_final_message()).stop_reason == "end_turn"
        count = await client.messages.count_tokens(model="default", system="Be brief.", messages=HI)
        assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="default", max_tokens=5, messages=HI, extra_body={"top_q": 1})
        assert info.value.body["error"]["type"] == "invalid_request_error"
        bad = anthropic.AsyncAnthropic(base_url="http://wllm", api_key="nope", http_client=http, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model="default", max_tokens=5, messages=HI)
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-x", max_tokens=5, messages=HI)

    asyncio.run(main())
