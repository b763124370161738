"""Tool calling and reasoning for chat completions: checking the request, preparing the prompt, the grammar,
and turning each reply back into content, `reasoning_content` and `tool_calls`.

`plan_tools` checks `tools`, `tool_choice` and the tool history (400s with the reason) and picks the format:
the chat template's own (markers in its text, or `--tool-call-parser`), or the generic one, whose tools are
described in a system message because the template knows none. `ChatPlan.finish_prompt` then looks at the
rendered prompt (does it end inside a `<think>` block?) and builds the llguidance grammar for
`SamplingParams.grammar`. `ReplyParser` splits one reply, whole or streamed, into events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from wllm.entrypoints.openai.errors import bad_request
from wllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from wllm.entrypoints.openai.reasoning import (
    ReasoningDelta,
    ReasoningFormat,
    ReasoningParser,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
    reasoning_format,
)
from wllm.entrypoints.openai.tool_parsers import (
    FORMATS,
    PARSERS,
    ContentDelta,
    ToolArgsDelta,
    ToolCallParser,
    ToolCallStart,
    detect_tool_format,
)
from wllm.entrypoints.openai.tool_parsers.generic import calls_as_text, tool_instructions
from wllm.structured.tools import FunctionSpec, ReasoningSpec, ToolChoiceMode, ToolFormat, literal, tool_grammar

MAX_TOOLS = 128  # OpenAI's limit
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta


def template_text(tokenizer: Any, override: str | None, has_tools: bool) -> str | None:
    """The chat template a request renders with (None for tokenizers without one we can read)."""
    select = getattr(tokenizer, "select_chat_template", None)
    if select is None:
        return None
    try:
        return select(override, has_tools)
    except ValueError:
        return None  # no template: rendering reports that itself


def check_tool_history(messages: list[ChatMessage]) -> None:
    """400 for a history no model could have produced: a tool result that answers no call, a call whose
    arguments are not JSON, tool calls on a turn other than the assistant's."""
    open_ids: set[str] | None = None  # ids of the calls the latest assistant turn made
    for i, msg in enumerate(messages):
        if msg.tool_calls is not None:
            if msg.role != "assistant":
                raise bad_request(
                    f"messages[{i}]: only assistant messages may have tool_calls, not {msg.role!r}",
                    param=f"messages[{i}].tool_calls",
                )
            for j, call in enumerate(msg.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function"
                if not _FUNCTION_NAME.match(call.function.name):
                    raise bad_request(
                        f"{where}.name {call.function.name!r} is not a valid function name", param=f"{where}.name"
                    )
                try:
                    json.loads(call.function.arguments)
                except ValueError as exc:
                    raise bad_request(
                        f"{where}.arguments is not valid JSON ({exc}): {call.function.arguments[:100]!r}",
                        param=f"{where}.arguments",
                    ) from None
            open_ids = {call.id for call in msg.tool_calls}
            continue
        if msg.role == "tool":
            if msg.tool_call_id is None:
                raise bad_request(
                    f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                )
            if open_ids is None:
                raise bad_request(
                    f"messages[{i}]: a tool message must follow an assistant message with tool_calls",
                    param=f"messages[{i}]",
                )
            if msg.tool_call_id not in open_ids:
                raise bad_request(
                    f"messages[{i}]: tool_call_id {msg.tool_call_id!r} answers none of the calls of the "
                    f"assistant message before it ({', '.join(sorted(open_ids))})",
                    param=f"messages[{i}].tool_call_id",
                )
            continue
        open_ids = None


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


@dataclass
class ChatPlan:
    """What tool calling and reasoning change in one chat request."""

    tool_format: ToolFormat | None = None  # None: the reply's tool calls are not parsed
    mode: ToolChoiceMode = "none"
    named: str | None = None
    parallel: bool = True
    functions: list[FunctionSpec] = field(default_factory=list)
    template_tools: list[dict[str, Any]] | None = None  # what the chat template receives as `tools`
    generic: bool = False  # tools described in a system message (the template knows none)
    generic_tools: list[dict[str, Any]] | None = None  # the tools that system message describes
    masked_format: ToolFormat | None = None  # tool_choice "none": the format whose trigger is masked
    reasoning: ReasoningFormat | None = None
    in_reasoning: bool = False
    reasoning_closed: bool = False
    grammar: str | None = None
    special_markers: bool = False  # a marker is a special token: the text must keep special tokens

    @property
    def parses_output(self) -> bool:
        return self.tool_format is not None or self.reasoning is not None

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the template should see them; in the generic format the tools and their calls
        become text, since the template would not render them."""
        if not self.generic:
            return messages
        out = []
        for msg in messages:
            calls = msg.get("tool_calls")
            if msg["role"] == "assistant" and calls:
                text = calls_as_text(calls)
                content = msg.get("content")
                msg = {k: v for k, v in msg.items() if k != "tool_calls"}
                msg["content"] = f"{content}\n{text}" if content else text
            out.append(msg)
        if self.mode != "none" and self.generic_tools is not None:
            instructions = tool_instructions(self.generic_tools, self.mode, self.named, self.parallel)
            if out and out[0]["role"] in ("system", "developer") and isinstance(out[0].get("content"), str):
                first = dict(out[0])
                first["content"] = (first["content"] + "\n\n" + instructions) if first["content"] else instructions
                out[0] = first
            else:
                out.insert(0, {"role": "system", "content": instructions})
        return out

    def finish_prompt(self, prompt: str, token_ref: Callable[[str], str]) -> None:
        """Settle what depends on the rendered prompt: where the reply starts (in thinking or not) and the
        grammar."""
        if self.reasoning is not None:
            self.in_reasoning = prompt_opens_reasoning(prompt, self.reasoning)
            self.reasoning_closed = not self.in_reasoning and prompt_closes_reasoning(prompt, self.reasoning)
            if any(token_ref(m).startswith("<[") for m in (self.reasoning.start, self.reasoning.end)):
                self.special_markers = True
        fmt = self.tool_format or self.masked_format
        if fmt is None:
            return
        if self.tool_format is not None and fmt.trigger and token_ref(fmt.trigger).startswith("<["):
            self.special_markers = True  # the parser must see the trigger token in the text
        think = None
        if self.reasoning is not None and not self.reasoning_closed:
            think = ReasoningSpec(self.reasoning.start, self.reasoning.end, open_in_prompt=self.in_reasoning)
        mode: ToolChoiceMode = "required" if self.named is not None else self.mode
        self.grammar = tool_grammar(
            fmt, self.functions, mode, parallel=self.parallel, reasoning=think, token_ref=token_ref
        )

    def reply_parser(self) -> ReplyParser:
        reasoning = None
        if self.reasoning is not None:
            reasoning = ReasoningParser(
                self.reasoning, in_reasoning=self.in_reasoning, allow_start=not self.reasoning_closed
            )
        tools = None
        if self.tool_format is not None:
            tools = PARSERS[self.tool_format.name]([f.name for f in self.functions])
        return ReplyParser(reasoning, tools)


def plan_tools(req: ChatCompletionRequest, template: str | None, tool_parser: str, reasoning_parser: str) -> ChatPlan:
    """Check the request's tool fields and history (400s) and decide the format and mode."""
    check_tool_history(req.messages)
    plan = ChatPlan(reasoning=reasoning_format(reasoning_parser, template))
    choice = req.tool_choice
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _FUNCTION_NAME.match(fn.name):
            raise bad_request(
                f"tools[{i}].function.name {fn.name!r} is not a valid function name (letters, digits, "
                "underscores and dashes, at most 64)",
                param=f"tools[{i}].function.name",
            )
        if fn.name in names:
            raise bad_request(f"tools[{i}]: two tools are named {fn.name!r}", param=f"tools[{i}].function.name")
        names.add(fn.name)
        if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema of type 'object', got type "
                f"{fn.parameters.get('type')!r}",
                param=f"tools[{i}].function.parameters",
            )
        plan.functions.append(FunctionSpec(fn.name, fn.parameters))
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools (tools: {known})",
                param="tool_choice",
            )
        plan.named = choice.function.name
        plan.mode = "required"
        plan.functions = [f for f in plan.functions if f.name == plan.named]
    elif choice in ("required", "auto"):
        if not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
        plan.mode = choice
    else:
        plan.mode = "auto" if tools and choice is None else "none"
    plan.parallel = req.parallel_tool_calls is not False
    if not tools:
        return plan
    name = detect_tool_format(template) if tool_parser == "auto" else tool_parser
    fmt = FORMATS[name]
    dicts = [_drop_none(msgspec.to_builtins(t)) for t in tools]
    plan.generic = name == "generic"
    if plan.generic:
        plan.generic_tools = dicts  # described in a system message, not by the template
    else:
        plan.template_tools = dicts  # OpenAI semantics: the model sees the tools even under "none"
    if plan.mode == "none":
        plan.masked_format = None if plan.generic else fmt  # nothing to mask where the tools are not shown
    else:
        plan.tool_format = fmt
    return plan


class ReplyParser:
    """One reply's text (fed whole or in pieces) to events: reasoning first, then content and tool calls."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.calls > 0

    def feed(self, text: str) -> list[Event]:
        events: list[Any] = self.reasoning.feed(text) if self.reasoning is not None else [ContentDelta(text)]
        return self._tool_events(events, final=False)

    def finish(self) -> list[Event]:
        events: list[Any] = self.reasoning.finish() if self.reasoning is not None else []
        return self._tool_events(events, final=True)

    def _tool_events(self, events: list[Any], final: bool) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for e in events:
            if isinstance(e, ContentDelta):
                out += self.tools.feed(e.text)
            else:
                out.append(e)
        if final:
            out += self.tools.finish()
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the reply made a call and ended by itself."""
        return "tool_calls" if reason == "stop" and self.made_calls else reason


@dataclass
class ReplyMessage:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]


def assemble(events: list[Event]) -> ReplyMessage:
    """The whole message from a reply's events (a non-streamed response)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    args: list[list[str]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append(ToolCall(id=e.id, function=FunctionCall(name=e.name, arguments="")))
            args.append([])
        else:
            args[e.index].append(e.text)
    for call, parts in zip(calls, args):
        call.function.arguments = "".join(parts)
    text = "".join(content)
    # OpenAI: content is null when the reply is only calls (or only reasoning).
    return ReplyMessage(
        text if text or not (calls or reasoning) else None, "".join(reasoning) if reasoning else None, calls
    )


def delta_messages(events: list[Event]) -> list[DeltaMessage]:
    """A stream's deltas for these events: consecutive text of one kind, and consecutive argument text of
    one call, travel together."""
    out: list[DeltaMessage] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentDelta):
            if last is not None and isinstance(last.content, str) and last.tool_calls is msgspec.UNSET:
                last.content += e.text
            else:
                out.append(DeltaMessage(content=e.text))
        elif isinstance(e, ReasoningDelta):
            if last is not None and isinstance(last.reasoning_content, str):
                last.reasoning_content += e.text
            else:
                out.append(DeltaMessage(reasoning_content=e.text))
        elif isinstance(e, ToolCallStart):
            out.append(
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(
                            index=e.index,
                            id=e.id,
                            type="function",
                            function=DeltaFunctionCall(name=e.name, arguments=""),
                        )
                    ]
                )
            )
        else:
            prev = last.tool_calls[-1] if last is not None and isinstance(last.tool_calls, list) else None
            if prev is not None and prev.index == e.index and prev.id is msgspec.UNSET:
                prev.function.arguments += e.text  # type: ignore[union-attr, operator]
            else:
                out.append(
                    DeltaMessage(
                        tool_calls=[DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments=e.text))]
                    )
                )
    return out


def token_ref_for(tokenizer: Any) -> Callable[[str], str]:
    """`token_ref` for grammars: a special token of this tokenizer as `<[id]>`, other text as a literal."""
    special: frozenset[int] = getattr(tokenizer, "all_special_ids", frozenset())
    to_id = getattr(tokenizer, "token_to_id", None)

    def ref(text: str) -> str:
        token_id = to_id(text) if to_id is not None else None
        if token_id is not None and token_id in special:
            return f"<[{token_id}]>"
        return literal(text)

    return ref
