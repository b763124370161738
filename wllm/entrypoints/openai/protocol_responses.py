"""msgspec Structs for OpenAI's Responses API (`POST /v1/responses`): the request, its input items, the
response object, its output items and the typed stream events.

Requests are strict as in protocol.py: unknown fields are a 400 naming them. Input items and tools
arrive as JSON objects and are converted per `type` (serving_responses.py), because a message item
may leave out `type` (the "easy" input message), which a tagged union cannot express.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from wllm.entrypoints.openai.protocol import _Strict

# ---------------------------------------------------------------- requests


class TextFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    # json_schema only
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict, kw_only=True):
    format: TextFormat | None = None


class ReasoningConfig(_Strict, kw_only=True):
    # Known, not implemented: refused when set (nothing here controls how long a model reasons).
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Strict, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # handed to the chat path as is
    stream: bool = False
    store: bool = True  # kept in the server's bounded in-memory store (GET /v1/responses/{id})
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back and stored
    # Accepted, no effect: the end-user id (for the provider's abuse monitoring); it changes no output.
    user: str | None = None
    # Known, not implemented: refused when set to anything but the no-op value.
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None


class ContentPart(_Strict, kw_only=True):
    """A part of an input message or of a function call's output; only text parts are supported (the
    other parts' fields are declared so that they get a 400 naming their type, not an unknown field)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # output_text parts echoed back from a response
    logprobs: list[Any] | None = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None


class MessageItem(_Strict, kw_only=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(_Strict, kw_only=True):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = msgspec.field(default_factory=list)
    content: list[ContentPart] | None = None
    # Known, not implemented: refused when set (there is nothing to decrypt it with).
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem
INPUT_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningInputItem,
}


class FunctionTool(_Strict, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# ---------------------------------------------------------------- responses


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText] = msgspec.field(default_factory=list)


class OutputFunctionCall(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class OutputReasoning(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    status: str


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ReasoningEcho(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho = msgspec.field(default_factory=ReasoningEcho)
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# ---------------------------------------------------------------- stream events


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0  # set as the event is sent


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(_Event, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error"):
    code: str | None
    message: str
    param: str | None


ResponseEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)
