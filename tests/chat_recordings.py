"""Chat-completions outputs with tool calls and reasoning, in the OpenAI wire format a tool parser and a
reasoning parser give (vLLM's shapes: `reasoning_content`, `tool_calls` with ids, streamed arguments in
pieces under one `index`). The Responses and Messages translation tests feed them to their builders, so
the tool round trips are tested before the chat path parses tool calls itself."""

from __future__ import annotations

from typing import Any

WEATHER_ARGS = '{"city": "Paris"}'

TOOL_CALL_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-rec1",
    "object": "chat.completion",
    "created": 1764547200,
    "model": "qwen3",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "The user wants the weather and the time.",
                "tool_calls": [
                    {
                        "id": "call_w1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS},
                    },
                    {"id": "call_t2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "total_tokens": 150,
        "prompt_tokens_details": {"cached_tokens": 64},
    },
}

TEXT_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-rec2",
    "object": "chat.completion",
    "created": 1764547201,
    "model": "qwen3",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "It is 22 C in Paris."},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ],
    "usage": {"prompt_tokens": 160, "completion_tokens": 9, "total_tokens": 169},
}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-rec3",
        "object": "chat.completion.chunk",
        "created": 1764547202,
        "model": "qwen3",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


TOOL_CALL_CHUNKS: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "The user wants "}),
    _chunk({"reasoning_content": "the weather and the time."}),
    _chunk({"content": "Let me check."}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk(
        {
            "tool_calls": [
                {"index": 1, "id": "call_t2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ]
        }
    ),
    _chunk({}, "tool_calls"),
    {
        "id": "chatcmpl-rec3",
        "object": "chat.completion.chunk",
        "created": 1764547202,
        "model": "qwen3",
        "choices": [],
        "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
    },
]
