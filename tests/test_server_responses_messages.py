"""A real `wllm serve` on the embedded SmolLM2-135M-Instruct, driven by the official `openai` client's
`responses.create` and the official `anthropic` client's `messages.create` / `count_tokens`. Greedy
answers must equal what /v1/chat/completions gives for the same conversation: both APIs are
translations onto the one chat path."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from test_server_e2e import ServerProcess, metrics

from wllm.model.default_model import DEFAULT_MODEL_NAME, default_model_path

pytestmark = pytest.mark.slow

KEY = "sk-e2e-apis"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model_path()
    s = ServerProcess(
        [
            "--api-key",
            KEY,
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "0.25",
            "--log-format",
            "json",
            "--no-engine-process",
        ],
        tmp_path_factory.mktemp("apis") / "server.log",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    # The Anthropic client sends the key as `x-api-key` and its `anthropic-version` header.
    return anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(oai: openai.OpenAI) -> str:
    r = oai.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert "Paris" in r.choices[0].message.content
    return r.choices[0].message.content


def test_responses_create_equals_chat(oai: openai.OpenAI, reference: str) -> None:
    r = oai.responses.create(
        model=DEFAULT_MODEL_NAME, instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=24
    )
    assert r.output_text == reference
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete")
    kinds = []
    with oai.responses.stream(
        model=DEFAULT_MODEL_NAME, instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=24
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert final.output_text == reference and final.status == r.status
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if r.status == "completed" else "response.incomplete",
    ]
    # the stored response continues the conversation
    follow = oai.responses.create(
        model=DEFAULT_MODEL_NAME, previous_response_id=r.id, input="And of Italy?", temperature=0, max_output_tokens=16
    )
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens


def test_messages_create_equals_chat(claude: anthropic.Anthropic, reference: str) -> None:
    greedy = {"extra_body": {"temperature": 0}}  # this SDK version no longer has a temperature argument
    ask = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(model=DEFAULT_MODEL_NAME, system=SYSTEM, messages=ask, max_tokens=24, **greedy)
    assert m.content[0].text == reference and m.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(
        model=DEFAULT_MODEL_NAME, system=SYSTEM, messages=ask, max_tokens=24, **greedy
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == reference and final.stop_reason == m.stop_reason
    raw = claude.messages.create(
        model=DEFAULT_MODEL_NAME, system=SYSTEM, messages=ask, max_tokens=24, stream=True, **greedy
    )
    kinds = [event.type for event in raw]  # the SDK drops pings (test_api_messages sees them on the wire)
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    count = claude.messages.count_tokens(model=DEFAULT_MODEL_NAME, system=SYSTEM, messages=ask)
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=claude.base_url, api_key="wrong", max_retries=0).messages.create(
            model=DEFAULT_MODEL_NAME, messages=ask, max_tokens=4
        )
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=DEFAULT_MODEL_NAME, messages=ask, max_tokens=4, extra_body={"top_q": 1})
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_metrics_and_disconnect(server: ServerProcess) -> None:
    before = metrics(server)
    body = {
        "model": DEFAULT_MODEL_NAME,
        "max_tokens": 300,
        "stream": True,
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    with httpx.stream("POST", f"{server.root}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 12:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = metrics(server)
        if not m["wllm_num_requests_running"]:
            break
        time.sleep(0.2)
    assert m["wllm_num_requests_running"] == 0.0
    assert '"error":"client disconnected"' in server.log.read_text(encoding="utf-8")
    key = "wllm_requests_total[('endpoint', '/v1/messages'), ('status', '200')]"
    assert m[key] > before.get(key, 0.0)
    assert "/v1/responses" in str(list(m))


def test_readme_examples_run(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's SDK example (chat, completions, responses.create, the Anthropic client), as written but
    for this server's address and key."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    [code] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "responses.create" in b]
    assert "messages.create" in code and 'model = "SmolLM2-135M-Instruct"' in code
    code = code.replace("http://127.0.0.1:8000", server.root).replace('api_key="unused"', f'api_key="{KEY}"')
    exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out


def test_responses_function_tool_round_trip(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
    r = oai.responses.create(
        model=DEFAULT_MODEL_NAME,
        input="Weather in Paris?",
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=64,
    )
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    # The answer after the result: tool_choice none, or a greedy 135M model calls the tool again.
    done = oai.responses.create(
        model=DEFAULT_MODEL_NAME,
        tools=tools,
        tool_choice="none",
        temperature=0,
        max_output_tokens=32,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call,
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"},
        ],
    )
    assert done.output_text


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = claude.messages.create(
        model=DEFAULT_MODEL_NAME, messages=ask, tools=tools, max_tokens=64,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    done = claude.messages.create(
        model=DEFAULT_MODEL_NAME,
        tools=tools,
        tool_choice={"type": "none"},
        max_tokens=32,
        messages=[
            *ask,
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C and sunny"}]},
        ],
    )
    assert done.content[0].type == "text"
