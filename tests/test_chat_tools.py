"""Tool calling and reasoning through the HTTP layer, over a scripted engine with real families' chat templates.

What is checked: the template receives the tools and renders tool history; bad tool input is a 400 naming the
reason; replies become `tool_calls` / `reasoning_content` with finish_reason "tool_calls" only when a call was
made; streamed deltas reassemble to exactly the non-streamed message; each tool_choice puts the right
llguidance grammar into SamplingParams (checked with llguidance itself).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import msgspec
import pytest
from fake_engine import ScriptedEngine
from litestar.testing import TestClient
from test_api_server import sse
from tool_templates import (
    LLAMA3_TEMPLATE,
    MISTRAL_TEMPLATE,
    MISTRAL_V11_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN25_TEMPLATE,
    R1_TEMPLATE,
    SMOLLM2_TEMPLATE,
    TemplateTokenizer,
)

from wllm.entrypoints.openai.app import create_app
from wllm.entrypoints.openai.chat_tools import plan_tools
from wllm.entrypoints.openai.config import ServerConfig
from wllm.entrypoints.openai.protocol import ChatCompletionRequest

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def make(template: str, reply: str = "Hello!", **config: Any) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(max_model_len=8192, replies=(reply,))
    engine.tokenizer = TemplateTokenizer(template)
    return TestClient(create_app(engine, ServerConfig(served_model_names=["tiny"], **config))), engine


def post(client: TestClient, **body: Any) -> Any:
    return client.post(CHAT, json={"model": "tiny", "messages": ASK, "temperature": 0, **body})


def prompt_of(engine: ScriptedEngine) -> str:
    return engine.tokenizer.decode(engine.calls[-1][0])


def grammar_of(engine: ScriptedEngine) -> str | None:
    return engine.calls[-1][1].grammar


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abc123XYZ",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abc123XYZ", "content": "21 C, sunny"},
]


# ------------------------------------------------------------------ templates receive tools and history


@pytest.mark.parametrize(
    ("template", "tools_mark", "call_mark", "result_mark"),
    [
        (
            QWEN25_TEMPLATE,
            '<tools>\n{"type": "function", "function": {"name": "get_weather"',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>",
        ),
        (
            LLAMA3_TEMPLATE,
            '"name": "get_weather"',
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>',
            '<|start_header_id|>ipython<|end_header_id|>\n\n"21 C, sunny"<|eot_id|>',  # Meta's template: tojson
        ),
        (
            MISTRAL_TEMPLATE,
            '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"',
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123XYZ"}]</s>',
            '[TOOL_RESULTS] {"content": "21 C, sunny", "call_id": "abc123XYZ"}[/TOOL_RESULTS]',
        ),
        (
            QWEN3_TEMPLATE,
            '<tools>\n{"type": "function"',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<tool_response>\n21 C, sunny\n</tool_response>",
        ),
        (
            MISTRAL_V11_TEMPLATE,
            '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>',
            "[TOOL_RESULTS]21 C, sunny[/TOOL_RESULTS]",
        ),
    ],
    ids=["qwen2.5", "llama3.1", "mistral", "qwen3", "mistral-v11"],
)
def test_templates_render_tools_and_tool_history(
    template: str, tools_mark: str, call_mark: str, result_mark: str
) -> None:
    client, engine = make(template)
    with client:
        r = post(client, messages=HISTORY, tools=[WEATHER, TIME])
        assert r.status_code == 200, r.text
        prompt = prompt_of(engine)
    assert tools_mark in prompt
    assert '"description": "Current weather in a city"' in prompt and '"get_time"' in prompt
    assert call_mark in prompt
    assert result_mark in prompt
    assert "None" not in prompt and "null" not in prompt  # no unset field leaks into the prompt


def test_generic_format_describes_tools_in_a_system_message() -> None:
    client, engine = make(SMOLLM2_TEMPLATE)
    with client:
        assert post(client, messages=HISTORY, tools=[WEATHER]).status_code == 200
        prompt = prompt_of(engine)
        assert prompt.startswith("<|im_start|>system\nYou can call functions.")
        assert '"name": "get_weather"' in prompt and "plain text" in prompt
        # the model sees its own earlier call, written the way it is asked to write calls
        assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}<|im_end|>' in prompt
        # a system message of the client's keeps its text, with the tools after it
        post(
            client, messages=[{"role": "system", "content": "Be brief."}, *ASK], tools=[WEATHER], tool_choice="required"
        )
        prompt = prompt_of(engine)
        assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
        assert "You must call a function now." in prompt
        # tool_choice none in the generic format: the tools are not shown and nothing is enforced
        post(client, tools=[WEATHER], tool_choice="none")
        assert "You can call functions" not in prompt_of(engine) and grammar_of(engine) is None


# ------------------------------------------------------------------ bad input


BAD = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "two tools are named"),
    (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools[0].function.name",
        "not a valid function name",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
        "type 'object'",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "cannot be enforced",
    ),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", None),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "extra": 1}}]},
        "tools[0].function.extra",
        "unknown field",
    ),
    (
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "21 C"}]},
        "messages[1]",
        "must follow an assistant message with tool_calls",
    ),
    ({"messages": [*HISTORY[:2], {"role": "tool", "content": "21 C"}]}, "messages[2].tool_call_id", "needs the"),
    (
        {"messages": [*HISTORY[:2], {"role": "tool", "tool_call_id": "other", "content": "21 C"}]},
        "messages[2].tool_call_id",
        "answers none of the calls",
    ),
    (
        {
            "messages": [
                ASK[0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{city: Paris"},
                        }
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
    (
        {
            "messages": [
                ASK[0],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "Expected `str`",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages[0].tool_calls",
        "only assistant messages",
    ),
]


@pytest.mark.parametrize(("body", "param", "fragment"), BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_tool_input_is_400(body: dict[str, Any], param: str, fragment: str | None) -> None:
    client, engine = make(QWEN25_TEMPLATE)
    with client:
        r = post(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if fragment is not None:
        assert fragment in err["message"], err
    assert not engine.calls  # nothing reached the engine


def test_mistral_ids_round_trip_through_its_template() -> None:
    # Mistral's template refuses ids that are not 9 characters; the ids this server makes for it are.
    client, _ = make(MISTRAL_TEMPLATE, reply='[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    with client:
        body = post(client, tools=[WEATHER]).json()
        (call,) = body["choices"][0]["message"]["tool_calls"]
        assert len(call["id"]) == 9
        turn = {"role": "assistant", "content": None, "tool_calls": [call]}
        r = post(
            client,
            tools=[WEATHER],
            messages=[*ASK, turn, {"role": "tool", "tool_call_id": call["id"], "content": "21 C"}],
        )
        assert r.status_code == 200, r.text
        bad = [*ASK, {**turn, "tool_calls": [{**call, "id": "call_1"}]}]
        r = post(client, tools=[WEATHER], messages=bad)
        assert r.status_code == 400 and "length 9" in r.json()["error"]["message"]


# ------------------------------------------------------------------ replies: whole and streamed


def streamed(client: TestClient, **body: Any) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """The message a client rebuilds from the stream, its finish reason, and the raw deltas."""
    r = post(client, stream=True, **body)
    assert r.status_code == 200, r.text
    content, reasoning, calls, finish, deltas = "", "", [], None, []
    for event in sse(r.text):
        if event == "[DONE]":
            break
        for choice in event["choices"]:
            delta = choice["delta"]
            deltas.append(delta)
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] == len(calls) and tc["type"] == "function"
                    assert tc["function"]["arguments"] == ""  # the first delta of a call: its name, no arguments
                    calls.append(
                        {
                            "id": tc["id"],
                            "type": "function",
                            "function": {"name": tc["function"]["name"], "arguments": ""},
                        }
                    )
                else:
                    assert set(tc["function"]) == {"arguments"}
                    calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, finish, deltas


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if "tool_calls" in out:
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out["tool_calls"]]
    return out


REPLIES = [
    (
        MISTRAL_V11_TEMPLATE,
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        {"content": "Sure.", "calls": [("get_weather", {"city": "Paris"}), ("get_time", {})]},
        "tool_calls",
    ),
    (
        QWEN25_TEMPLATE,
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        {
            "content": "I will check.",
            "calls": [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
        },
        "tool_calls",
    ),
    (QWEN25_TEMPLATE, "It is sunny in Paris.", {"content": "It is sunny in Paris.", "calls": []}, "stop"),
    (
        LLAMA3_TEMPLATE,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        {"content": None, "calls": [("get_weather", {"city": "Paris"})]},
        "tool_calls",
    ),
    (
        MISTRAL_TEMPLATE,
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
        {"content": None, "calls": [("get_time", {})]},
        "tool_calls",
    ),
    (
        SMOLLM2_TEMPLATE,
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        {"content": None, "calls": [("get_weather", {"city": "Oslo"})]},
        "tool_calls",
    ),
    (
        QWEN25_TEMPLATE,
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        {"content": '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', "calls": []},
        "stop",
    ),
]


@pytest.mark.parametrize(
    ("template", "reply", "expected", "finish"),
    REPLIES,
    ids=["mistral-v11", "hermes-2-calls", "hermes-text", "llama", "mistral", "generic", "unknown-name"],
)
def test_reply_to_tool_calls_and_stream_reassembles(
    template: str, reply: str, expected: dict[str, Any], finish: str
) -> None:
    client, _ = make(template, reply=reply)
    with client:
        body = post(client, tools=[WEATHER, TIME]).json()
        (choice,) = body["choices"]
        message = choice["message"]
        assert choice["finish_reason"] == finish
        assert message["content"] == expected["content"]
        calls = message.get("tool_calls", [])
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected["calls"]
        for c in calls:
            assert c["type"] == "function" and len(c["id"]) >= 9
        stream_message, stream_finish, _ = streamed(client, tools=[WEATHER, TIME])
        assert stream_finish == finish
        assert without_ids(stream_message) == without_ids(message)


def test_streamed_arguments_are_raw_fragments_in_order() -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client, _ = make(QWEN25_TEMPLATE, reply=reply)
    with client:
        _, finish, deltas = streamed(client, tools=[WEATHER])
    fragments = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls") or [] if "id" not in tc]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'  # as the model wrote it
    assert not any(d.get("content") for d in deltas)  # no piece of the markup leaked as content
    assert finish == "tool_calls"


def test_truncated_call_keeps_finish_reason_length() -> None:
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    client, _ = make(QWEN25_TEMPLATE, reply=head + '{"city": "Paris"}}\n</tool_call>')
    budget = len(head) + len('{"city": "Par')  # one token per character
    with client:
        body = post(client, tools=[WEATHER], max_tokens=budget).json()
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
        message, finish, _ = streamed(client, tools=[WEATHER], max_tokens=budget)
        assert finish == "length" and without_ids(message) == without_ids(choice["message"])


def test_n2_streams_parse_per_choice() -> None:
    reply = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    client, _ = make(QWEN25_TEMPLATE, reply=reply)
    with client:
        r = post(client, tools=[TIME], n=2, stream=True)
        calls: dict[int, list[str]] = {0: [], 1: []}
        for event in sse(r.text):
            if event != "[DONE]":
                for choice in event["choices"]:
                    for tc in choice["delta"].get("tool_calls") or []:
                        calls[choice["index"]].append(tc["function"].get("name", "") + tc["function"]["arguments"])
        assert {i: "".join(parts) for i, parts in calls.items()} == {0: "get_time{}", 1: "get_time{}"}


# ------------------------------------------------------------------ reasoning


def test_reasoning_content_whole_and_streamed() -> None:
    reply = (
        "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    client, engine = make(QWEN3_TEMPLATE, reply=reply)
    with client:
        body = post(client, tools=[WEATHER]).json()
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants the weather."
        assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        stream_message, _, deltas = streamed(client, tools=[WEATHER])
        assert without_ids(stream_message) == without_ids(message)
        assert any("reasoning_content" in d for d in deltas)
        # the grammar lets the model think first: a <think> block, then the calls
        grammar = grammar_of(engine)
        assert grammar is not None and "think" in json.loads(grammar)["grammars"][0]["lark_grammar"]


def test_reasoning_off_and_opened_by_the_prompt() -> None:
    client, engine = make(QWEN3_TEMPLATE, reply="<think>not reasoning</think> Hi")
    with client:
        # enable_thinking=False writes an empty block into the prompt: the reply is content only
        body = post(client, chat_template_kwargs={"enable_thinking": False}).json()
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>not reasoning</think> Hi"}
    client, engine = make(R1_TEMPLATE, reply="First, 2 + 2.\n</think>\n\nIt is 4.")
    with client:
        message = post(client).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "It is 4.", "reasoning_content": "First, 2 + 2."}
    client, engine = make(R1_TEMPLATE, reply="First, 2 + 2.\n</think>\n\nIt is 4.", reasoning_parser="none")
    with client:
        message = post(client).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "First, 2 + 2.\n</think>\n\nIt is 4."}


def test_plain_chat_is_untouched() -> None:
    client, engine = make(QWEN25_TEMPLATE, reply="Hello <tool_call> is just text here")
    with client:
        body = post(client).json()  # no tools: nothing is parsed, nothing enforced
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello <tool_call> is just text here"}
        assert grammar_of(engine) is None


# ------------------------------------------------------------------ grammars in SamplingParams


@functools.lru_cache(maxsize=1)
def smol_tokenizers() -> tuple[Any, llguidance.LLTokenizer]:
    """SmolLM2's tokenizer and llguidance's view of it (built once: about a third of a second)."""
    from wllm.model.default_model import default_model_path
    from wllm.model.tokenizer import Tokenizer

    t = Tokenizer.from_gguf(default_model_path())
    return t, llguidance.LLTokenizer(t.backend.to_str(), eos_token=sorted(t.eos_token_ids))


def accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher takes `text`, token by token on SmolLM2's tokenizer, as a whole reply."""
    t, lt = smol_tokenizers()
    m = llguidance.LLMatcher(lt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = t.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_each_tool_choice_sets_its_grammar() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client, engine = make(QWEN25_TEMPLATE)
    with client:
        post(client, tools=[WEATHER, TIME], tool_choice="required")
        required = grammar_of(engine)
        post(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
        named = grammar_of(engine)
        post(client, tools=[WEATHER, TIME])  # auto is the default with tools
        auto = grammar_of(engine)
        post(client, tools=[WEATHER, TIME], tool_choice="none")
        none = grammar_of(engine)
        post(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
        single = grammar_of(engine)
    assert all(g is not None for g in (required, named, auto, none, single))
    two = call + "\n" + call
    assert accepts(required, call) and accepts(required, two) and not accepts(required, "Sunny.")
    assert accepts(single, call) and not accepts(single, two)
    assert not accepts(named, call) and accepts(
        named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert accepts(auto, "Sunny.") and accepts(auto, "Let me see. " + call)
    assert not accepts(auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert accepts(none, "Sunny.") and not accepts(none, call)


def test_tool_call_parser_flag_overrides_the_template() -> None:
    client, engine = make(QWEN25_TEMPLATE, reply='{"name": "get_time", "arguments": {}}', tool_call_parser="generic")
    with client:
        body = post(client, tools=[TIME]).json()
        prompt = prompt_of(engine)
    assert "You can call functions" in prompt and "<tools>" not in prompt  # the template got no tools
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="xml").validate()
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="maybe").validate()


def test_special_token_triggers_keep_special_tokens_in_the_text() -> None:
    def ref(text: str) -> str:
        return "<[128010]>" if text == "<|python_tag|>" else json.dumps(text)

    auto = plan_tools(
        msgspec.convert({"messages": ASK, "tools": [WEATHER]}, ChatCompletionRequest), LLAMA3_TEMPLATE, "auto", "auto"
    )
    auto.finish_prompt("<|start_header_id|>assistant<|end_header_id|>\n\n", ref)
    assert auto.tool_format is not None and auto.tool_format.name == "llama3_json"
    assert auto.special_markers and auto.grammar is not None and "<[128010]>" in auto.grammar
    none = plan_tools(
        msgspec.convert({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, ChatCompletionRequest),
        LLAMA3_TEMPLATE,
        "auto",
        "auto",
    )
    none.finish_prompt("", ref)
    assert none.tool_format is None and not none.special_markers  # nothing is parsed: text as usual
    assert none.grammar is not None and "PROSE" in none.grammar  # but a leading JSON call is masked


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "x-guidance": "abc"},
        {"type": None},
        {"type": "object", "properties": 5},
        {"type": "object", "$ref": "#/nope"},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
        {"type": "object", "required": "a"},
        {"type": "object", "properties": {"a": {"minimum": "x"}}},
    ],
)
def test_hostile_parameter_schemas_are_400_never_500(parameters: dict[str, Any]) -> None:
    client, _ = make(QWEN25_TEMPLATE)
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with client:
        for choice in ("auto", "required"):
            r = post(client, tools=[tool], tool_choice=choice)
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"].startswith("tools"), r.text


def test_streamed_logprobs_are_not_lost_while_text_is_held_back() -> None:
    reply = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    client, _ = make(QWEN25_TEMPLATE, reply=reply)
    with client:
        r = post(client, tools=[TIME], stream=True, logprobs=True, stream_options={"include_usage": True})
        events = [e for e in sse(r.text) if e != "[DONE]"]
    tokens = [t["token"] for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert "".join(tokens) == reply  # every token's logprob once, in order, markup included
    assert events[-1]["usage"]["completion_tokens"] == len(reply)
