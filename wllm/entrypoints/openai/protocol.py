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


class FunctionCallParam(_Strict, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it (checked to parse)


class ToolCallParam(_Strict, kw_only=True):
    """A call in an assistant turn of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(_Strict, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    # Accepted: calls generated under a grammar always follow the schema, strict or not.
    strict: bool | None = None


class ToolDefinition(_Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict, kw_only=True):
    name: str


class NamedToolChoice(_Strict, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
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
    # Beam search (vLLM's fields): the beam width is best_of if set, else n; the best n beams are returned.
    # best_of other than n is refused without use_beam_search, as are length_penalty and early_stopping.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
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
    # Tool calling (wllm/entrypoints/openai/chat_tools.py, docs/tools.md).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
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


class EmbeddingRequest(_Strict, kw_only=True):
    """OpenAI's embeddings request. `input` is a string, a list of strings, a list of token ids or a list
    of token-id lists (its items are checked by the handler: msgspec takes one array type per union)."""

    model: str | None = None
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # Accepted, no effect: OpenAI's end-user id.
    user: str | None = None
    # vLLM extra: cut inputs longer than this many tokens (-1: the model's maximum) instead of a 400.
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Strict, kw_only=True):
    """The Cohere / Jina rerank request: documents are strings or {"text": ...} objects."""

    model: str | None = None
    query: str
    documents: list[Any]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    # Accepted, no effect: an end-user id, as on the OpenAI routes.
    user: str | None = None


class ScoreRequest(_Strict, kw_only=True):
    """vLLM's score request: `text_1` against each `text_2` (one to one, one to many, or pairwise lists)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    user: str | None = None


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


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


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


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's first delta has its id, type and name (arguments ""); later ones add argument text."""

    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: DeltaFunctionCall | UnsetType = UNSET


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


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
    task: str = "generate"  # what the model serves: generate, embed or rerank


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


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


# ------------------------------------------------------------------ GET /v1/engine/stats (the web UI's engine view)


class RequestCounts(msgspec.Struct):
    running: int
    waiting: int
    swapped: int


class KVCacheStats(msgspec.Struct):
    usage: float  # fraction of blocks referenced by some request (0-1)
    blocks_total: int | None  # None: the engine does not report block counts
    blocks_used: int | None
    blocks_cached: int | None  # blocks holding prefix-cache content, in use or free and reusable


class PrefixCacheStats(msgspec.Struct):
    hit_rate: float  # hits / queries since start (0-1)
    queries: int  # prompt tokens looked up since start
    hits: int  # of which were found in the cache


class PreemptionStats(msgspec.Struct):
    total: int
    swap: int
    recompute: int


class LatencyPercentiles(msgspec.Struct):
    count: int  # samples in the window
    p50: float | None  # seconds; None without samples
    p90: float | None
    p99: float | None


class EngineStatsResponse(msgspec.Struct):
    time: float  # the server's clock (Unix seconds), for rates between two reads
    healthy: bool
    requests: RequestCounts
    tokens_per_second: float  # generated tokens per second over the last 10 s
    generation_tokens: int  # generated tokens since start (a counter: its rate between reads is tokens/s)
    kv_cache: KVCacheStats
    prefix_cache: PrefixCacheStats
    preemptions: PreemptionStats
    window_s: float  # the span the latency percentiles cover (the newest samples)
    ttft_s: LatencyPercentiles  # time to first token
    itl_s: LatencyPercentiles  # inter-token latency
