"""POST /v1/responses (OpenAI's Responses API) as a translation onto the one chat path.

A Responses request becomes a `ChatCompletionRequest` (`to_chat_request`): `instructions` a system
message, input items chat messages (function calls an assistant turn's `tool_calls`, their outputs
`tool` messages, reasoning items the next assistant turn's `reasoning_content`), `text.format`
`response_format`, function tools and `tool_choice` their chat shapes. `ChatStart` runs it, and
`ResponseBuilder` turns the chat completion, or the chat chunks as they come, into output items and
the typed event sequence; the chat path's tool parser makes the `function_call` items. Whatever the chat
path refuses (today: JSON output) is refused here with the same 400, under this API's field names.

Responses with `store` (OpenAI's default) are kept in a bounded in-memory `ResponseStore`, per API
key, for GET /v1/responses/{id} and `previous_response_id`.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
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
from wllm.entrypoints.openai.errors import APIError, bad_request
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
from wllm.entrypoints.openai.protocol_responses import (
    INPUT_ITEM_TYPES,
    ContentPart,
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningInputItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseEvent,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from wllm.entrypoints.openai.serving_chat import ChatStart
from wllm.entrypoints.openai.serving_common import RequestRecord, ServerContext
from wllm.entrypoints.openai.sse import SSE_HEADERS, sse_typed_event

# Chat-path field names as a Responses client knows them, for the chat path's errors.
FIELD_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}
# A Responses function tool is flat: `tools[0].name`, not the chat shape's `tools[0].function.name`.
FIELD_PATHS = ((r"\btools\[(\d+)\]\.function\.", r"tools[\1]."),)
TEXT_PARTS = {"input_text", "output_text", "text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- the store


class StoredResponse(msgspec.Struct):
    response: ResponseObject
    items: list[dict[str, Any]]  # the whole conversation as input items: what `previous_response_id` continues
    size: int


class ResponseStore:
    """Responses kept for GET /v1/responses/{id} and `previous_response_id`: in memory, per API key (a key
    sees only its own), bounded by count and by encoded size, least recently used evicted first. Lost on
    restart."""

    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # handlers run on one loop; the lock keeps it safe anywhere

    def put(self, owner: str | None, response: ResponseObject, items: list[dict[str, Any]]) -> None:
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(items))
        if size > self.max_bytes:
            return  # larger than the whole store: never kept (GET then answers 404)
        with self._lock:
            self._pop((owner, response.id))
            self._entries[(owner, response.id)] = StoredResponse(response, items, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.size

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((owner, response_id))
            if entry is not None:
                self._entries.move_to_end((owner, response_id))
            return entry

    def delete(self, owner: str | None, response_id: str) -> bool:
        with self._lock:
            return self._pop((owner, response_id))

    def _pop(self, key: tuple[str | None, str]) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self._bytes -= old.size
        return True

    def __len__(self) -> int:
        return len(self._entries)


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' is stored on this server (responses are kept in "
        "memory, per API key, while there is room).",
        param="response_id",
        code="not_found",
    )


# ---------------------------------------------------------------- request -> chat


def parse_input(value: str | list[dict[str, Any]]) -> list[InputItem]:
    """The input as typed items: a string is one user message; each object is converted by its `type`."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[InputItem] = []
    for i, raw in enumerate(value):
        kind = raw.get("type", "message")
        cls = INPUT_ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise bad_request(
                f"input[{i}]: items of type {kind!r} are not supported by this server (supported: "
                f"{', '.join(INPUT_ITEM_TYPES)})",
                param=f"input[{i}].type",
            )
        items.append(convert_at(raw, cls, f"input[{i}]"))
    return items


def _texts(parts: list[ContentPart], where: str, allowed: set[str]) -> list[str]:
    out = []
    for j, part in enumerate(parts):
        if part.type not in allowed:
            raise bad_request(
                f"{where}[{j}]: content of type {part.type!r} is not supported by this server; it "
                f"accepts {', '.join(sorted(allowed))} parts only",
                param=f"{where}[{j}].type",
            )
        if part.text is None:
            raise bad_request(f"{where}[{j}]: a {part.type} part needs `text`", param=f"{where}[{j}].text")
        out.append(part.text)
    return out


def to_chat_messages(items: list[InputItem], first: int = 0) -> list[ChatMessage]:
    """Input items as chat messages, in order. Function calls join the assistant turn they follow (one
    model turn can say something and call tools); a reasoning item goes with the assistant turn after it.
    `first`: the request's index of items[0], for errors (negative when a stored conversation comes first)."""
    out: list[ChatMessage] = []
    reasoning: list[str] = []

    def assistant() -> ChatMessage:
        if out and out[-1].role == "assistant" and not reasoning:
            return out[-1]
        msg = ChatMessage(role="assistant", content=None, reasoning_content="\n".join(reasoning) or None)
        reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i + first}]"
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                content: str | list[ChatContentPart] = item.content
            else:
                allowed = {"output_text"} if item.role == "assistant" else {"input_text", "text"}
                texts = _texts(item.content, f"{where}.content", allowed)
                content = [ChatContentPart(type="text", text=t) for t in texts]  # joined as chat joins parts
            if item.role == "assistant":
                msg = assistant()
                if msg.content is not None or msg.tool_calls:
                    msg = ChatMessage(role="assistant", content=None)
                    out.append(msg)
                msg.content = content
            else:
                out.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            msg = assistant()
            call = ToolCallParam(id=item.call_id, function=FunctionCallParam(name=item.name, arguments=item.arguments))
            msg.tool_calls = [*(msg.tool_calls or []), call]
        elif isinstance(item, FunctionCallOutputItem):
            output = (
                item.output
                if isinstance(item.output, str)
                else "\n".join(_texts(item.output, f"{where}.output", {"input_text", "output_text", "text"}))
            )
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
        elif isinstance(item, ReasoningInputItem):
            if item.encrypted_content is not None:
                raise bad_request(
                    f"{where}.encrypted_content is not supported: this server does not encrypt "
                    "reasoning; send its `content` instead",
                    param=f"{where}.encrypted_content",
                )
            parts = item.content if item.content else item.summary
            reasoning.extend(_texts(parts, f"{where}.content", {"reasoning_text", "summary_text"}))
    if reasoning:  # reasoning with no assistant turn after it: a turn of its own
        assistant()
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[ToolDefinition] | None:
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: tools of type {kind!r} are not supported by this server; only 'function' tools are",
                param=f"tools[{i}].type",
            )
        tool = convert_at(raw, FunctionTool, f"tools[{i}]")
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        out.append(ToolDefinition(type="function", function=function))
    return out


ToolMode = Literal["none", "auto", "required"]
_MODES: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required"}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> ToolMode | NamedToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in _MODES:
        return _MODES[choice]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if set(choice) != {"type", "name"}:
            extra = sorted(set(choice) - {"type", "name"})[0]
            raise bad_request(f"unknown field `tool_choice.{extra}`", param=f"tool_choice.{extra}")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    raise bad_request(
        f"tool_choice {choice!r} is not supported by this server: give 'auto', 'none', 'required' "
        "or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _chat_response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema is None:
        raise bad_request("text.format of type json_schema needs `name` and `schema`", param="text.format")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
    for field in ("description", "strict"):
        if getattr(fmt, field) is not None:
            schema[field] = getattr(fmt, field)
    return {"type": "json_schema", "json_schema": schema}


def check_unsupported(req: ResponsesRequest) -> None:
    """400 for the Responses fields this server declares but does not implement, when set."""
    r = req.reasoning
    if r is not None and (r.effort, r.summary, r.generate_summary) != (None, None, None):
        field = "effort" if r.effort is not None else "summary" if r.summary is not None else "generate_summary"
        raise bad_request(
            f"reasoning.{field} is not supported by this server: how a model reasons is set by its "
            "chat template (a reasoning model's reasoning comes back as reasoning items)",
            param=f"reasoning.{field}",
        )
    if req.include:
        raise bad_request(f"include {req.include[0]!r} is not supported by this server", param="include")
    if req.truncation == "auto":
        raise bad_request(
            "truncation 'auto' is not supported: a conversation that does not fit is a 400, never cut",
            param="truncation",
        )
    if req.background:
        raise bad_request("background responses are not supported by this server", param="background")


def to_chat_request(req: ResponsesRequest, items: list[InputItem], first: int = 0) -> ChatCompletionRequest:
    """The chat completion request this Responses request means (`items`: the whole conversation, the
    request's input from `items[-first]` on)."""
    messages = to_chat_messages(items, first)
    if req.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    if not messages:
        raise bad_request("input must contain at least one item", param="input")
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=_chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_chat_response_format(req),
        user=req.user,
        stream=req.stream,
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
    )


# ---------------------------------------------------------------- chat -> response


def response_usage(usage: ViewUsage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(0),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


class _Open:
    """The output item being written: its index, the item and the text or arguments so far."""

    def __init__(
        self, index: int, item: OutputMessage | OutputReasoning | OutputFunctionCall, tool_index: int | None = None
    ) -> None:
        self.index = index
        self.item = item
        self.tool_index = tool_index
        self.parts: list[str] = []


class ResponseBuilder:
    """Chat output -> output items and the Responses event sequence.

    `feed` takes chat deltas (a non-streamed chat message is fed as one delta) and returns the events
    they make; `finish` closes the open item and returns the last events. Events are built from copies,
    so each one says what was true when it was made."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.open: _Open | None = None
        self._seq = 0

    def _ev(self, event: ResponseEvent) -> ResponseEvent:
        event.sequence_number = self._seq
        self._seq += 1
        return event

    def _snapshot(self) -> ResponseObject:
        return msgspec.structs.replace(self.response, output=list(self.response.output))

    def start(self) -> list[ResponseEvent]:
        return [
            self._ev(ResponseCreated(response=self._snapshot())),
            self._ev(ResponseInProgress(response=self._snapshot())),
        ]

    def _open_item(
        self, item: OutputMessage | OutputReasoning | OutputFunctionCall, tool_index: int | None = None
    ) -> list[ResponseEvent]:
        events = self._close("completed")
        index = len(self.response.output)
        self.response.output.append(item)
        self.open = _Open(index, item, tool_index)
        events.append(self._ev(OutputItemAdded(output_index=index, item=msgspec.structs.replace(item))))
        if isinstance(item, OutputMessage):
            events.append(
                self._ev(
                    ContentPartAdded(item_id=item.id, output_index=index, content_index=0, part=OutputText(text=""))
                )
            )
        elif isinstance(item, OutputReasoning):
            events.append(
                self._ev(
                    ContentPartAdded(item_id=item.id, output_index=index, content_index=0, part=ReasoningText(text=""))
                )
            )
        return events

    def _close(self, status: str) -> list[ResponseEvent]:
        cur, self.open = self.open, None
        if cur is None:
            return []
        text = "".join(cur.parts)
        item, i = cur.item, cur.index
        item.status = status
        events: list[ResponseEvent] = []
        if isinstance(item, OutputMessage):
            item.content = [OutputText(text=text)]
            events += [
                self._ev(OutputTextDone(item_id=item.id, output_index=i, content_index=0, text=text)),
                self._ev(ContentPartDone(item_id=item.id, output_index=i, content_index=0, part=OutputText(text=text))),
            ]
        elif isinstance(item, OutputReasoning):
            item.content = [ReasoningText(text=text)]
            events += [
                self._ev(ReasoningTextDone(item_id=item.id, output_index=i, content_index=0, text=text)),
                self._ev(
                    ContentPartDone(item_id=item.id, output_index=i, content_index=0, part=ReasoningText(text=text))
                ),
            ]
        else:
            item.arguments = text
            events.append(
                self._ev(FunctionCallArgumentsDone(item_id=item.id, output_index=i, name=item.name, arguments=text))
            )
        events.append(self._ev(OutputItemDone(output_index=i, item=msgspec.structs.replace(item))))
        return events

    def feed(self, delta: ViewMessage, whole: bool = False) -> list[ResponseEvent]:
        """The events for one chat delta; `whole`: a whole chat message, whose tool calls have no index."""
        events: list[ResponseEvent] = []
        reasoning = delta.reasoning_text
        if reasoning:
            if self.open is None or not isinstance(self.open.item, OutputReasoning):
                events += self._open_item(OutputReasoning(id=_id("rs"), status="in_progress"))
            assert self.open is not None
            self.open.parts.append(reasoning)
            events.append(
                self._ev(
                    ReasoningTextDelta(
                        item_id=self.open.item.id, output_index=self.open.index, content_index=0, delta=reasoning
                    )
                )
            )
        if delta.content:
            if self.open is None or not isinstance(self.open.item, OutputMessage):
                events += self._open_item(OutputMessage(id=_id("msg"), status="in_progress"))
            assert self.open is not None
            self.open.parts.append(delta.content)
            events.append(
                self._ev(
                    OutputTextDelta(
                        item_id=self.open.item.id, output_index=self.open.index, content_index=0, delta=delta.content
                    )
                )
            )
        for k, call in enumerate(delta.tool_calls or []):
            tool_index = k if whole else call.index
            cur = self.open
            if cur is None or cur.tool_index != tool_index:
                item = OutputFunctionCall(
                    id=_id("fc"),
                    call_id=call.id or _id("call"),
                    name=call.function.name or "",
                    arguments="",
                    status="in_progress",
                )
                events += self._open_item(item, tool_index)
                cur = self.open
            assert cur is not None
            if call.function.arguments:
                cur.parts.append(call.function.arguments)
                events.append(
                    self._ev(
                        FunctionCallArgumentsDelta(
                            item_id=cur.item.id, output_index=cur.index, delta=call.function.arguments
                        )
                    )
                )
        return events

    def finish(self, finish_reason: str | None, usage: ViewUsage | None) -> list[ResponseEvent]:
        """Close the response: a length stop makes it `incomplete` (`max_output_tokens`)."""
        events: list[ResponseEvent] = []
        if not self.response.output:  # nothing generated: still one (empty) message, as clients expect
            events += self._open_item(OutputMessage(id=_id("msg"), status="in_progress"))
        incomplete = finish_reason == "length"
        events += self._close("incomplete" if incomplete else "completed")
        r = self.response
        r.status = "incomplete" if incomplete else "completed"
        r.incomplete_details = IncompleteDetails("max_output_tokens") if incomplete else None
        r.usage = response_usage(usage)
        final = (
            ResponseIncomplete(response=self._snapshot())
            if incomplete
            else ResponseCompleted(response=self._snapshot())
        )
        events.append(self._ev(final))
        return events

    def fail(self, exc: APIError) -> list[ResponseEvent]:
        """A stream that failed after it began: an `error` event, then `response.failed`."""
        self.open = None
        self.response.status = "failed"
        self.response.error = ResponseError(code=str(exc.code or exc.type), message=exc.message)
        return [
            self._ev(
                ErrorEvent(code=None if exc.code is None else str(exc.code), message=exc.message, param=exc.param)
            ),
            self._ev(ResponseFailed(response=self._snapshot())),
        ]


def build_response(builder: ResponseBuilder, chat: ViewChat) -> ResponseObject:
    """A whole (non-streamed) chat completion through the builder."""
    choice = chat.choices[0]
    builder.feed(choice.message or ViewMessage(), whole=True)
    builder.finish(choice.finish_reason, chat.usage)
    return builder.response


def encode_event(event: ResponseEvent) -> bytes:
    return sse_typed_event(type(event).__struct_config__.tag, event)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the handlers


async def create_response(
    ctx: ServerContext,
    store: ResponseStore,
    req: ResponsesRequest,
    request: Request[Any, Any, Any],
    record: RequestRecord,
) -> Response[Any] | Stream:
    check_unsupported(req)
    owner = record.key_id
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = store.get(owner, req.previous_response_id)
        if entry is None:
            err = not_found(req.previous_response_id)
            raise APIError(400, err.message, param="previous_response_id", code="previous_response_not_found")
        history = entry.items
    new_items = parse_input(req.input)
    conversation = history + [msgspec.to_builtins(i) for i in new_items]
    chat_req = to_chat_request(req, parse_input(history) + new_items, -len(history))
    response_id = _id("resp")
    try:
        start = await ChatStart.begin(ctx, chat_req, request, record, request_id=response_id,
                                      endpoint="/v1/responses")
    except APIError as exc:
        raise renamed(exc, FIELD_NAMES, FIELD_PATHS) from None
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    builder = ResponseBuilder(
        ResponseObject(
            id=response_id,
            created_at=start.created,
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=start.model,
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            store=req.store,
            temperature=req.temperature,
            text={"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            tool_choice=req.tool_choice or "auto",
            tools=list(req.tools or []),
            top_p=req.top_p,
            user=req.user,
            metadata=dict(req.metadata or {}),
        )
    )

    def keep(response: ResponseObject) -> None:
        if req.store:
            store.put(owner, response, conversation + [msgspec.to_builtins(i) for i in response.output])

    if not req.stream:
        response = build_response(builder, view(await start.response()))
        keep(response)
        return Response(response)

    chunks = await start.chunks()

    async def events() -> AsyncIterator[bytes]:
        finish_reason: str | None = None
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
                    finish_reason = choice.finish_reason or finish_reason
        except APIError as exc:
            for event in builder.fail(exc):
                yield encode_event(event)
            return
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        for event in builder.finish(finish_reason, usage):
            yield encode_event(event)
        keep(builder.response)

    return Stream(
        events(), media_type="text/event-stream", headers=SSE_HEADERS, background=BackgroundTask(start.cleanup)
    )
