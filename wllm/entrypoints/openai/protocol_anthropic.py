"""msgspec Structs for Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the
request and its content blocks, the message, the stream events and the error body.

Requests are strict as in protocol.py: unknown fields are a 400 naming them. Content blocks are a
tagged union on `type`; image and document blocks are declared so that they get a 400 saying that
their type is not supported rather than an unknown-tag error.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from wllm.entrypoints.openai.protocol import _Strict

# ---------------------------------------------------------------- requests


class CacheControl(_Strict, kw_only=True):
    type: str
    ttl: str | None = None


class TextBlock(_Strict, kw_only=True, tag="text", tag_field="type"):
    text: str
    # Null only: what this server's text blocks carry, sent back when a client returns the assistant turn.
    citations: None = None
    # Accepted, no effect: the prefix cache reuses every shared prefix without being asked.
    cache_control: CacheControl | None = None


class ImageBlock(_Strict, kw_only=True, tag="image", tag_field="type"):
    source: Any = None  # refused: this server serves text models
    cache_control: CacheControl | None = None


class DocumentBlock(_Strict, kw_only=True, tag="document", tag_field="type"):
    source: Any = None  # refused
    title: Any = None
    context: Any = None
    citations: Any = None
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict, kw_only=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    # Accepted: the result's text reaches the chat template as the tool message; chat templates have
    # no error flag to render it with.
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None  # accepted: ours are empty; the thinking text goes to the template


ContentBlock = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(_Strict, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class CustomTool(_Strict, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None  # accepted, no effect


class ToolChoice(_Strict, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only
    disable_parallel_tool_use: bool | None = None  # handed to the chat path as parallel_tool_calls


class Metadata(_Strict, kw_only=True):
    # Accepted, no effect: an opaque end-user id (for the provider's abuse monitoring).
    user_id: str | None = None


class ThinkingConfig(_Strict, kw_only=True):
    # Known, not implemented: refused unless disabled (how a model reasons is its chat template's).
    type: str
    budget_tokens: int | None = None


class OutputFormat(_Strict, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Strict, kw_only=True):
    format: OutputFormat | None = None  # handed to the chat path as response_format json_schema
    # Known, not implemented: refused when set (how long a model reasons is its chat template's).
    effort: str | None = None


class _MessagesFields(_Strict, kw_only=True):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    # Raw objects, converted per tool in serving_messages: a server tool (`bash_...`, `web_search_...`)
    # gets a 400 naming its type instead of a schema error.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # accepted, no effect (see TextBlock)


class MessagesRequest(_MessagesFields, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None


class CountTokensRequest(_MessagesFields, kw_only=True):
    pass


# ---------------------------------------------------------------- responses


class OutTextBlock(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str
    citations: None = None


class OutThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


class OutToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutTextBlock | OutThinkingBlock | OutToolUseBlock


class Usage(msgspec.Struct, kw_only=True):
    # Anthropic's split: input_tokens are the prompt tokens not read from the (prefix) cache.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[OutBlock]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessageObject


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: OutBlock


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: Usage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class ErrorInfo(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    """An error, as a response body and as a stream's `error` event."""

    error: ErrorInfo


MessageEvent = (
    MessageStart | ContentBlockStart | Ping | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
)
