"""msgspec Structs for the OpenAI wire format (requests and responses) plus vLLM-style extras.

Requests are strict (`forbid_unknown_fields=True`, and `decoding.StrictRequest` decodes them with
`strict=True`, so `"10"` is not a number): a field this server does not implement is a 400 naming it,
never silently ignored. Every declared request field is either honoured or refused with a 400 when
set (`serving_common.reject_unsupported` and the handlers); the few accepted but unused ones are
marked "accepted, no effect" with the reason.
Response fields typed `... | UnsetType = UNSET` are left out of the JSON entirely when unset
(OpenAI omits `usage` from stream chunks unless `stream_options.include_usage` is set, and a
final delta is `{}`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

# ---------------------------------------------------------------- requests


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request object: unknown fields are a 400 naming them."""


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False


class ContentPart(_Strict, kw_only=True):
    """One part of a multi-part message; only `text` parts are supported (the others are declared so
    that they get a 400 saying their type is not supported rather than "unknown field")."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, handed to the chat template (templates read `reasoning_content`).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # Accepted, no effect when null: OpenAI SDKs echo a response message back with `refusal: null`;
    # a refusal text is refused (no template renders it).
    refusal: str | None = None
    # The deprecated single function call: refused when set (send `tool_calls`).
    function_call: Any = None


class StructuredOutputs(_Strict, kw_only=True):
    """vLLM's `structured_outputs` extra: at most one constraint (see wllm.structured.grammars)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict, kw_only=True):
    """Fields shared by chat and text completions (OpenAI names plus vLLM extras)."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    # Accepted, no effect: OpenAI's end-user id (for the provider's abuse monitoring); SDKs and
    # proxies send it, and it changes no output.
    user: str | None = None
    # Known, not implemented: refused when set (beam search; best_of other than n).
    use_beam_search: bool = False
    best_of: int | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    # Structured output (at most one of these; docs/structured_output.md): OpenAI's response_format, vLLM's
    # guided_* extras and their newer `structured_outputs` shape.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tools are rendered into the prompt by the chat template; the reply is returned as text (no
    # tool-call parsing), so only tool_choice "none" and "auto" are honoured.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # Accepted, no effect: a reply never has more than one tool call (it has none).
    parallel_tool_calls: bool | None = None
    # The deprecated functions API: refused when set (send `tools`).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists. msgspec allows one
    # array type per union, so the shapes are told apart in serving_completions.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TokenizeRequest(_Strict, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Each applies to one input kind only (default true); set with the other kind it is a 400.
    add_special_tokens: bool | None = None  # prompt
    add_generation_prompt: bool | None = None  # messages


class DetokenizeRequest(_Strict, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobToken]


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatCompletionChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    system_fingerprint: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "wllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class HealthResponse(msgspec.Struct):
    status: str
