"""POST /v1/messages (Anthropic's Messages API) as a translation onto the one chat path.

A Messages request becomes a `ChatCompletionRequest` (`to_chat_request`): `system` a system message,
text blocks message content, an assistant turn's `tool_use` blocks its `tool_calls` (input as JSON
arguments), `tool_result` blocks `tool` messages, `thinking` blocks `reasoning_content`; tools and
`tool_choice` (auto / any / tool / none) their chat shapes; `stop_sequences` `stop`. `ChatStart` runs
it and `MessageBuilder` turns the chat completion, or its chunks as they come, into content blocks and
Anthropic's events. Errors, all of them, are Anthropic's body (`anthropic_handlers`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from wllm.entrypoints.openai.chat_view import (
    ViewChat,
    ViewMessage,
    ViewUsage,
    convert_at,
    renamed,
    view,
)
from wllm.entrypoints.openai.errors import EXCEPTION_HANDLERS, APIError, ErrorResponse, bad_request
from wllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallParam,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    StreamOptions,
    ToolCallParam,
    ToolDefinition,
)
from wllm.entrypoints.openai.protocol import ContentPart as ChatContentPart
from wllm.entrypoints.openai.protocol_anthropic import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    CustomTool,
    DocumentBlock,
    ErrorBody,
    ErrorInfo,
    ImageBlock,
    InputJsonDelta,
    InputMessage,
    MessageDelta,
    MessageEvent,
    MessageObject,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutBlock,
    OutTextBlock,
    OutThinkingBlock,
    OutToolUseBlock,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from wllm.entrypoints.openai.serving_chat import ChatStart, prepare_chat
from wllm.entrypoints.openai.serving_common import RequestRecord, ServerContext
from wllm.entrypoints.openai.sse import SSE_HEADERS, sse_typed_event

FIELD_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}
# Anthropic's custom tools are flat and call their parameters `input_schema`; its `any` is chat's `required`.
FIELD_PATHS = (
    (r"\btools\[(\d+)\]\.function\.parameters\b", r"tools[\1].input_schema"),
    (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"\btool_choice 'required'", "tool_choice 'any'"),
)

# ---------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(exc: APIError) -> ErrorBody:
    """An APIError in Anthropic's words: the type from the status, the field named in the message (the
    body has no `param`)."""
    status = exc.status_code
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = exc.message
    if exc.code == "invalid_api_key" and "Missing" in message:
        message = "Missing API key: send it as `x-api-key: <key>` (or `Authorization: Bearer <key>`)."
    elif exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return ErrorBody(ErrorInfo(type=kind, message=message))


def _anthropic(handler: Callable[[Request[Any, Any, Any], Any], Response[Any]]) -> Callable[..., Response[Any]]:
    """The app's error handler with its body restated in Anthropic's shape (same status and headers), so
    every rule of the OpenAI routes (validation, 401, 404, 413, 429, 503) holds here too."""

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        response = handler(request, exc)
        status = response.status_code or 500  # the app's handlers always set one
        err = msgspec.json.decode(response.content, type=ErrorResponse).error
        api = APIError(
            status,
            err.message,
            type=err.type,
            param=err.param,
            code=None if err.code is None else str(err.code),
        )
        return Response(
            content=msgspec.json.encode(error_body(api)),
            status_code=status,
            media_type="application/json",
            headers=dict(response.headers),
        )

    return handle


# Route-level exception handlers of the Messages routes (the guard's 401 and 429 pass through them too).
ANTHROPIC_HANDLERS: dict[type[Exception], Any] = {cls: _anthropic(h) for cls, h in EXCEPTION_HANDLERS.items()}
MESSAGES_PATHS = ("/v1/messages", "/messages")


def by_path(handler: Callable[[Request[Any, Any, Any], Any], Response[Any]]) -> Callable[..., Response[Any]]:
    """An app-level handler that answers Anthropic's shape under the Messages paths: errors raised before
    any route is matched (a 405 for the wrong method) never reach the routes' own handlers."""
    anthropic = _anthropic(handler)

    def handle(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        path = request.scope["path"]
        if any(path == p or (path.startswith(p) and path[len(p)] == "/") for p in MESSAGES_PATHS):  # URL paths
            return anthropic(request, exc)
        return handler(request, exc)

    return handle


# ---------------------------------------------------------------- request -> chat


def _not_text(block: ImageBlock | DocumentBlock, where: str) -> APIError:
    kind = type(block).__struct_config__.tag
    return bad_request(
        f"{where}: {kind} blocks are not supported by this server (text models only)", param=f"{where}.type"
    )


def _texts(blocks: list[TextBlock | ImageBlock | DocumentBlock], where: str) -> list[str]:
    out = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise _not_text(block, f"{where}[{j}]")
        out.append(block.text)
    return out


def _arguments(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False)


def to_chat_messages(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[ChatMessage]:
    """Anthropic's conversation as chat messages: one chat message per text run, one `tool` message per
    tool_result (they come first in a user turn), one assistant message per assistant turn."""
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    out: list[ChatMessage] = []
    if system is not None:
        parts = (
            [ChatContentPart(type="text", text=t) for t in _texts(list(system), "system")]
            if isinstance(system, list)
            else system
        )
        out.append(ChatMessage(role="system", content=parts))
    for i, msg in enumerate(messages):
        where = f"messages[{i}].content"
        blocks = [TextBlock(text=msg.content)] if isinstance(msg.content, str) else msg.content
        if msg.role == "assistant":
            texts: list[str] = []
            calls: list[ToolCallParam] = []
            thinking: list[str] = []
            for j, block in enumerate(blocks):
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    function = FunctionCallParam(name=block.name, arguments=_arguments(block.input))
                    calls.append(ToolCallParam(id=block.id, function=function))
                elif isinstance(block, ThinkingBlock):
                    thinking.append(block.thinking)
                else:
                    kind = type(block).__struct_config__.tag
                    raise bad_request(
                        f"{where}[{j}]: an assistant turn cannot hold {kind} blocks here", param=f"{where}[{j}].type"
                    )
            content = [ChatContentPart(type="text", text=t) for t in texts] if texts else None
            out.append(
                ChatMessage(
                    role="assistant",
                    content=content,
                    tool_calls=calls or None,
                    reasoning_content="\n".join(thinking) or None,
                )
            )
            continue
        run: list[str] = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                run.append(block.text)
            elif isinstance(block, ToolResultBlock):
                if run:
                    out.append(ChatMessage(role="user", content=[ChatContentPart(type="text", text=t) for t in run]))
                    run = []
                result = block.content
                text = result if isinstance(result, str) else "\n".join(_texts(result or [], f"{where}[{j}].content"))
                out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text))
            elif isinstance(block, (ImageBlock, DocumentBlock)):
                raise _not_text(block, f"{where}[{j}]")
            else:
                kind = type(block).__struct_config__.tag
                raise bad_request(f"{where}[{j}]: a user turn cannot hold {kind} blocks", param=f"{where}[{j}].type")
        if run:
            out.append(ChatMessage(role="user", content=[ChatContentPart(type="text", text=t) for t in run]))
    if messages[-1].role == "assistant":
        raise bad_request(
            "a final assistant message (a prefill for the model to continue) is not supported by "
            "this server; end the conversation with a user message",
            param=f"messages[{len(messages) - 1}]",
        )
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type", "custom")
        if kind != "custom":
            raise bad_request(
                f"tools[{i}]: tools of type {kind!r} (server tools) are not supported by this "
                "server; only custom tools (name, description, input_schema) are",
                param=f"tools[{i}].type",
            )
        tool = convert_at(raw, CustomTool, f"tools[{i}]")
        function = FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema)
        out.append(ToolDefinition(type="function", function=function))
    return out


def _check(req: CountTokensRequest | MessagesRequest) -> None:
    if req.thinking is not None and req.thinking.type != "disabled":
        raise bad_request(
            f"thinking type {req.thinking.type!r} is not supported by this server: how a model "
            "reasons is set by its chat template (its reasoning comes back as thinking blocks)",
            param="thinking.type",
        )
    if req.output_config is not None and req.output_config.effort is not None:
        raise bad_request(
            "output_config.effort is not supported by this server: how long a model reasons is set "
            "by its chat template",
            param="output_config.effort",
        )
    choice = req.tool_choice
    if choice is not None and (choice.type == "tool") != (choice.name is not None):
        raise bad_request(
            "tool_choice.name is required with type 'tool' and only allowed with it", param="tool_choice.name"
        )


ToolMode = Literal["auto", "required", "none"]
_MODES: dict[str, ToolMode] = {"auto": "auto", "any": "required", "none": "none"}


def _chat_tool_choice(req: CountTokensRequest | MessagesRequest) -> ToolMode | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name or ""))  # _check: named
    return _MODES[choice.type]


def _prompt_request(req: CountTokensRequest | MessagesRequest) -> ChatCompletionRequest:
    """The conversation and its tools as a chat request: all that its prompt (and tool plan) depends on."""
    choice = req.tool_choice
    return ChatCompletionRequest(
        model=req.model,
        messages=to_chat_messages(req.system, req.messages),
        tools=_chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req),
        parallel_tool_calls=None
        if choice is None or choice.disable_parallel_tool_use is None
        else not choice.disable_parallel_tool_use,
    )


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request this Messages request means."""
    _check(req)
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise bad_request(f"temperature must be in [0, 1], got {req.temperature}", param="temperature")
    fmt = req.output_config.format if req.output_config is not None else None
    return msgspec.structs.replace(
        _prompt_request(req),
        max_tokens=req.max_tokens,
        stop=req.stop_sequences,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        response_format=None
        if fmt is None
        else {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}},
        user=req.metadata.user_id if req.metadata is not None else None,
        stream=req.stream,
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
    )


# ---------------------------------------------------------------- chat -> message


def usage_of(prompt_tokens: int, cached: int, output_tokens: int) -> Usage:
    return Usage(input_tokens=prompt_tokens - cached, output_tokens=output_tokens, cache_read_input_tokens=cached)


def stop_reason(
    finish_reason: str | None, matched: str | int | None, stop_sequences: list[str], used_tools: bool
) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) for a chat finish_reason and the matched stop."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or used_tools:
        return "tool_use", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


class _Open:
    def __init__(self, index: int, block: OutBlock, tool_index: int | None = None) -> None:
        self.index = index
        self.block = block
        self.tool_index = tool_index
        self.parts: list[str] = []


class MessageBuilder:
    """Chat output -> content blocks and Anthropic's stream events (message_start, content_block_start,
    ping after the first, content_block_delta..., content_block_stop, message_delta, message_stop)."""

    def __init__(self, message: MessageObject, stop_sequences: list[str]) -> None:
        self.message = message
        self.stop_sequences = stop_sequences
        self.open: _Open | None = None
        self._pinged = False

    def start(self) -> list[MessageEvent]:
        return [MessageStart(message=msgspec.structs.replace(self.message, content=[]))]

    def _open_block(self, block: OutBlock, tool_index: int | None = None) -> list[MessageEvent]:
        events = self._close()
        index = len(self.message.content)
        self.message.content.append(block)
        self.open = _Open(index, block, tool_index)
        events.append(ContentBlockStart(index=index, content_block=msgspec.structs.replace(block)))
        if not self._pinged:
            events.append(Ping())
            self._pinged = True
        return events

    def _close(self, truncated: bool = False) -> list[MessageEvent]:
        """Close the open block; `truncated`: the reply ended at max_tokens (only the last block can be cut)."""
        cur, self.open = self.open, None
        if cur is None:
            return []
        text = "".join(cur.parts)
        block = cur.block
        if isinstance(block, OutTextBlock):
            block.text = text
        elif isinstance(block, OutThinkingBlock):
            block.thinking = text
        else:
            block.input = parse_arguments(text, truncated)
        return [ContentBlockStop(index=cur.index)]

    def feed(self, delta: ViewMessage, whole: bool = False) -> list[MessageEvent]:
        """The events for one chat delta; `whole`: a whole chat message, whose tool calls have no index."""
        events: list[MessageEvent] = []
        reasoning = delta.reasoning_text
        if reasoning:
            if self.open is None or not isinstance(self.open.block, OutThinkingBlock):
                events += self._open_block(OutThinkingBlock(thinking=""))
            assert self.open is not None
            self.open.parts.append(reasoning)
            events.append(ContentBlockDelta(index=self.open.index, delta=ThinkingDelta(reasoning)))
        if delta.content:
            if self.open is None or not isinstance(self.open.block, OutTextBlock):
                events += self._open_block(OutTextBlock(text=""))
            assert self.open is not None
            self.open.parts.append(delta.content)
            events.append(ContentBlockDelta(index=self.open.index, delta=TextDelta(delta.content)))
        for k, call in enumerate(delta.tool_calls or []):
            tool_index = k if whole else call.index
            cur = self.open
            if cur is None or cur.tool_index != tool_index:
                block = OutToolUseBlock(
                    id=call.id or f"toolu_{uuid.uuid4().hex}", name=call.function.name or "", input={}
                )
                events += self._open_block(block, tool_index)
                cur = self.open
            assert cur is not None
            if call.function.arguments:
                cur.parts.append(call.function.arguments)
                events.append(ContentBlockDelta(index=cur.index, delta=InputJsonDelta(call.function.arguments)))
        return events

    def finish(self, finish_reason: str | None, matched: str | int | None, usage: Usage) -> list[MessageEvent]:
        events: list[MessageEvent] = []
        if not self.message.content:  # nothing generated: one empty text block
            events += self._open_block(OutTextBlock(text=""))
        events += self._close(truncated=finish_reason == "length")
        used_tools = any(isinstance(b, OutToolUseBlock) for b in self.message.content)
        reason, sequence = stop_reason(finish_reason, matched, self.stop_sequences, used_tools)
        m = self.message
        m.stop_reason, m.stop_sequence, m.usage = reason, sequence, usage
        events += [MessageDelta(delta=StopDelta(reason, sequence), usage=usage), MessageStop()]
        return events


def parse_arguments(text: str, truncated: bool = False) -> dict[str, Any]:
    """A tool call's JSON arguments as a tool_use block's input (an object). A call cut short by max_tokens
    has no whole object: its input is `{}`, and stop_reason `max_tokens` says why."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) and truncated:
        return {}
    if not isinstance(value, dict):
        raise APIError(
            500, f"The model's tool call arguments are not a JSON object: {text[:200]!r}", type="internal_error"
        )
    return value


def build_message(builder: MessageBuilder, chat: ViewChat, cached: int) -> MessageObject:
    """A whole (non-streamed) chat completion through the builder."""
    choice = chat.choices[0]
    builder.feed(choice.message or ViewMessage(), whole=True)
    u = chat.usage or ViewUsage()
    builder.finish(choice.finish_reason, choice.stop_reason, usage_of(u.prompt_tokens, cached, u.completion_tokens))
    return builder.message


def encode_event(event: MessageEvent | ErrorBody) -> bytes:
    return sse_typed_event(type(event).__struct_config__.tag, event)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the handlers


async def create_message(
    ctx: ServerContext, req: MessagesRequest, request: Request[Any, Any, Any], record: RequestRecord
) -> Response[Any] | Stream:
    chat_req = to_chat_request(req)
    try:
        start = await ChatStart.begin(ctx, chat_req, request, record, request_id=f"msg_{uuid.uuid4().hex}",
                                      endpoint="/v1/messages")
    except APIError as exc:
        raise renamed(exc, FIELD_NAMES, FIELD_PATHS) from None
    stops = list(req.stop_sequences or [])
    builder = MessageBuilder(
        MessageObject(id=start.request_id, content=[], model=start.model, usage=usage_of(len(start.prompt_ids), 0, 0)),
        stops,
    )
    if not req.stream:
        chat = view(await start.response())
        cached = chat.usage.cached_tokens if chat.usage is not None else 0
        return Response(build_message(builder, chat, cached))

    chunks = await start.chunks()
    cached = start.run.num_cached_tokens  # known once the first output has come
    builder.message.usage = usage_of(len(start.prompt_ids), cached, 0)

    async def events() -> AsyncIterator[bytes]:
        finish: tuple[str | None, str | int | None] = (None, None)
        usage: ViewUsage | None = None
        for event in builder.start():
            yield encode_event(event)
        try:
            async for chunk in chunks:
                v = view(chunk)
                usage = v.usage or usage
                for choice in v.choices:
                    if choice.delta is not None:
                        for event in builder.feed(choice.delta):
                            yield encode_event(event)
                    if choice.finish_reason is not None:
                        finish = (choice.finish_reason, choice.stop_reason)
            u = usage or ViewUsage(prompt_tokens=len(start.prompt_ids))
            for event in builder.finish(*finish, usage_of(u.prompt_tokens, u.cached_tokens, u.completion_tokens)):
                yield encode_event(event)
        except APIError as exc:
            yield encode_event(error_body(exc))
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    return Stream(
        events(), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(start.cleanup)
    )


async def count_tokens(ctx: ServerContext, req: CountTokensRequest, body_bytes: int = 0) -> TokenCount:
    """The prompt's tokens as /v1/messages would count them: the same tool plan (the generic format's tool
    system message included), template and tokenizer."""
    ctx = ctx.route(req.model, "/v1/messages/count_tokens", ("generate",))
    _check(req)
    try:
        prompt_ids, _ = await prepare_chat(ctx, _prompt_request(req), body_bytes)
    except APIError as exc:
        raise renamed(exc, FIELD_NAMES, FIELD_PATHS) from None
    return TokenCount(input_tokens=len(prompt_ids))
