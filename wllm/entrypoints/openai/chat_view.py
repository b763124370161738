"""What the Responses and Messages front ends read back from the chat path: its OpenAI wire format.

They translate chat completions (`ChatCompletionResponse`) and chunks (`ChatCompletionChunk`) into
their own shapes. They read them through these lenient views of the documented wire format, not
the server's own response Structs, so that fields the chat path gains (`tool_calls` from a tool
parser, `reasoning_content` from a reasoning parser) reach them with no change here, and unit tests
can feed them recorded chat outputs as plain JSON.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from wllm.entrypoints.openai.decoding import validation_error
from wllm.entrypoints.openai.errors import APIError

T = TypeVar("T")


class ViewFunction(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class ViewToolCall(msgspec.Struct, kw_only=True):
    index: int = 0  # streamed deltas only
    id: str | None = None
    type: str | None = None
    function: ViewFunction = msgspec.field(default_factory=ViewFunction)


class ViewMessage(msgspec.Struct, kw_only=True):
    """A whole chat message or one streamed delta (the same fields)."""

    role: str | None = None
    content: str | None = None
    # Reasoning parsers name it `reasoning_content` (vLLM's older name) or `reasoning` (its newer one).
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ViewToolCall] | None = None

    @property
    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class ViewChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: ViewMessage | None = None  # a chat completion
    delta: ViewMessage | None = None  # a chunk
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ViewCachedTokens(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class ViewUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: ViewCachedTokens | None = None

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details else 0


class ViewChat(msgspec.Struct, kw_only=True):
    """A chat completion or a chunk."""

    id: str = ""
    choices: list[ViewChoice] = msgspec.field(default_factory=list)
    usage: ViewUsage | None = None


def view(obj: Any) -> ViewChat:
    """A chat completion or chunk (a Struct of the server's, or its JSON as builtins) as a `ViewChat`."""
    return msgspec.convert(msgspec.to_builtins(obj), ViewChat)


# Field names that are also common words in messages: only `param` is renamed for these.
_PARAM_ONLY = frozenset({"messages", "stop"})


def renamed(exc: APIError, names: dict[str, str], paths: tuple[tuple[str, str], ...] = ()) -> APIError:
    """A chat-path error restated with this API's field names (`response_format` is `text.format` to a
    Responses client): `param` is renamed, and so is the field where the message names it. `paths`: regex
    substitutions for nested names (`tools[0].function.name` is `tools[0].name`), applied to both."""
    param = exc.param
    if param is not None:
        head, sep, tail = param.partition("[")
        if head in names:
            param = names[head] + sep + tail
    message = exc.message
    for old, new in names.items():
        if old not in _PARAM_ONLY:
            message = re.sub(rf"\b{re.escape(old)}\b", new, message)
    for pattern, repl in paths:
        message = re.sub(pattern, repl, message)
        param = None if param is None else re.sub(pattern, repl, param)
    return APIError(exc.status_code, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


def convert_at(raw: Any, type_: type[T], where: str) -> T:
    """`raw` (a JSON object of the request) as `type_`, strictly; a 400 naming the field under `where`."""
    try:
        return msgspec.convert(raw, type_, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        text = text.replace("`$", f"`$.{where}") if " - at `$" in text else f"{text} - at `$.{where}`"
        raise validation_error(msgspec.ValidationError(text)) from None

