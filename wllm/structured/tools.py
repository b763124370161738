"""llguidance grammars for tool calls, in each model family's own output format.

A grammar string built here goes into `SamplingParams.grammar`; the engine's llguidance matcher enforces it.
Each grammar is an llguidance top-level grammar: a Lark grammar (`%llguidance` dialect) for the format's
wrappers, plus one JSON-schema sub-grammar per tool for its arguments. The arguments get a sub-grammar of
their own (not an inline `%json` inside a bigger schema) so that `$ref`s into the tool's own `$defs` still
resolve against the schema the client wrote.

- `required` / a named tool: eager; the reply is one or more calls (exactly one without parallel calls).
- `auto`: lazy; free text until the format's trigger (`<tool_call>`, `[TOOL_CALLS]`, a leading `{`, ...),
  then a call that must parse and validate.
- `none`: the trigger is masked; the reply is text.

JSON inside calls is written the way `json.dumps` writes it (", " and ": ", no other whitespace), which is
how chat templates render tool calls in the history the models were trained on, and which leaves the model
no room for runaway whitespace. With a reasoning model the grammar first lets the thinking run freely up
to its end marker, so no JSON is ever forced into the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Layout = Literal["tagged", "bare", "array", "named"]
ToolChoiceMode = Literal["none", "auto", "required"]

# The separators chat templates use when they render a call with tojson / json.dumps.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A parameterless function takes exactly `{}` (OpenAI: no `parameters` means an empty parameter list).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls.

    - `tagged`: every call is `call_open {json} call_close` (Hermes / Qwen `<tool_call>`), text around them.
    - `bare`: the reply starts with JSON call objects, separated by `separator` (Llama 3.x, the generic
      format); `trigger`, when set, is a token that may also introduce them (`<|python_tag|>`).
    - `array`: `trigger` then a JSON array of call objects (Mistral `[TOOL_CALLS][...]`).
    - `named`: `trigger`, the function's name, `args_marker`, then the arguments object, per call, with no
      call object around them (Mistral's v11 templates: `[TOOL_CALLS]get_weather[ARGS]{...}`).

    A call object is `{"name": ..., <args key>: {...}}`; `args_keys[0]` is what grammars write, the others
    are also read (Llama models write `parameters` or `arguments`).
    """

    name: str
    layout: Layout
    trigger: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    args_keys: tuple[str, ...] = ("arguments",)
    args_marker: str = ""

    @property
    def args_key(self) -> str:
        return self.args_keys[0]


@dataclass(frozen=True)
class FunctionSpec:
    """One tool: its name and the JSON schema of its arguments (None: takes no arguments)."""

    name: str
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReasoningSpec:
    """A reasoning model's thinking block, for a grammar that must start after it.

    `open_in_prompt`: the prompt already ends inside the block (the template wrote `<think>`), so the reply
    starts with thinking; otherwise the model writes `start` itself first."""

    start: str = "<think>"
    end: str = "</think>"
    open_in_prompt: bool = False


# token_ref(text) -> a Lark fragment matching `text`: a special-token reference (`<[id]>`) where `text` is a
# special token of the model's tokenizer (regexes and string literals never match those), else a literal.
TokenRef = Callable[[str], str]


def literal(text: str) -> str:
    """A Lark string literal for `text`."""
    return json.dumps(text)


def _args_schema(fn: FunctionSpec) -> dict[str, Any]:
    schema = dict(fn.parameters) if fn.parameters is not None else dict(NO_PARAMETERS)
    guidance = schema.get("x-guidance")
    schema["x-guidance"] = {**(guidance if isinstance(guidance, dict) else {}), **JSON_STYLE}
    return schema


def _is_special(ref: str) -> bool:
    return ref.startswith("<[")


def tool_grammar(
    fmt: ToolFormat,
    functions: Sequence[FunctionSpec],
    mode: ToolChoiceMode,
    *,
    parallel: bool = True,
    reasoning: ReasoningSpec | None = None,
    token_ref: TokenRef = literal,
) -> str | None:
    """The llguidance grammar for `functions` under `mode`; None where nothing needs enforcing (`none` in
    the generic format, whose tools are not shown to the model at all)."""
    if mode != "none" and not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    rules: list[str] = ["%llguidance {}"]
    grammars: list[dict[str, Any]] = []
    # One rule per function: the call object with its name fixed and its arguments from its own schema.
    for i, fn in enumerate(functions if mode != "none" else ()):
        if fmt.layout == "named":
            rules.append(f"rest_{i}: {literal(fn.name)} {token_ref(fmt.args_marker)} @args_{i}")
            rules.append(f"fn_{i}: {token_ref(fmt.trigger)} rest_{i}")
        else:
            head = "{" + literal("name") + ": " + literal(fn.name) + ", " + literal(fmt.args_key) + ": "
            rules.append(f"fn_{i}: {literal(head)} @args_{i} {literal('}')}")
        grammars.append({"name": f"args_{i}", "json_schema": _args_schema(fn)})
    if functions and mode != "none":
        rules.append("call: " + " | ".join(f"fn_{i}" for i in range(len(functions))))
        if fmt.layout == "named":
            rules.append("tail: " + " | ".join(f"rest_{i}" for i in range(len(functions))))
    rules.append("TEXT: /(.|\\n)*/")
    rules.append("WS: /[ \\t\\r\\n]+/")

    body = _body(fmt, mode, parallel, token_ref, rules)
    if body is None:
        return None
    rules.append("body: " + body)
    rules.append("start: " + _reasoning_prefix(reasoning, token_ref, rules) + "body")
    lark = "\n".join(rules) + "\n"
    return json.dumps({"grammars": [{"name": "tool_calls", "lark_grammar": lark}, *grammars]})


def _reasoning_prefix(reasoning: ReasoningSpec | None, token_ref: TokenRef, rules: list[str]) -> str:
    if reasoning is None:
        return ""
    end = token_ref(reasoning.end)
    # Lazy: the thinking ends at the first end marker, whatever it contains before.
    rules.append(f"think: TEXT {end}" if _is_special(end) else f"think[lazy]: TEXT {end}")
    opener = "" if reasoning.open_in_prompt else token_ref(reasoning.start) + " "
    return f"{opener}think WS? "


def _body(fmt: ToolFormat, mode: ToolChoiceMode, parallel: bool, token_ref: TokenRef, rules: list[str]) -> str | None:
    if fmt.layout == "tagged":
        trigger = token_ref(fmt.trigger)
        rest = fmt.call_open[len(fmt.trigger) :]
        wrapped = (
            f"{trigger} {literal(rest)} call {literal(fmt.call_close)}"
            if rest
            else f"{trigger} call {literal(fmt.call_close)}"
        )
        if mode == "required":
            rules.append(f"block: {wrapped}")
            return f"block ({literal(fmt.separator)} block)*" if parallel else "block"
        if mode == "auto":
            # hd ends at the first trigger: plain text until then, a call after it.
            hd = f"hd: TEXT {trigger}" if _is_special(trigger) else f"hd[lazy]: TEXT {trigger}"
            tail = f"{literal(rest)} call {literal(fmt.call_close)}" if rest else f"call {literal(fmt.call_close)}"
            rules += [hd, f"tail: {tail}"]
            return "(hd tail)* TEXT" if parallel else "TEXT | hd tail"
        return _text_without(trigger, rules)
    if fmt.layout == "bare":
        sep = literal(fmt.separator)
        calls = f"call ({sep} call)*" if parallel else "call"
        # Text that cannot be a call: empty, or not starting with `{` (after any whitespace).
        rules.append("PROSE: /[ \\t\\r\\n]*[^{ \\t\\r\\n](.|\\n)*/")
        prose = "PROSE?"
        if mode == "required":
            return calls
        if mode == "auto":
            alts = [prose, calls]
            if fmt.trigger:
                alts.append(f"{token_ref(fmt.trigger)} {calls}")
            return " | ".join(alts)
        if not fmt.trigger:
            return None  # generic: the tools were never shown, nothing to mask
        trigger = token_ref(fmt.trigger)
        if _is_special(trigger):
            return prose
        rules.append(f"BARE_TRIGGER: /(?s:.*)/ {trigger} /(?s:.*)/")
        rules.append("SAFE_PROSE: PROSE & ~BARE_TRIGGER")
        return "SAFE_PROSE?"
    trigger = token_ref(fmt.trigger)
    if fmt.layout == "named":
        # Each call starts with the trigger (it is part of `call`); calls follow each other directly.
        if mode == "required":
            return "call+" if parallel else "call"
        if mode == "auto":
            if _is_special(trigger):
                return "TEXT call*" if parallel else "TEXT call?"
            # hd ends at the first trigger, the rest of that call follows it
            rules.append(f"hd[lazy]: TEXT {trigger}")
            return "(hd tail)* TEXT" if parallel else "TEXT | hd tail"
        return _text_without(trigger, rules)
    # array
    items = f"call ({literal(', ')} call)*" if parallel else "call"
    array = f"{literal('[')} {items} {literal(']')}"
    rules.append(f"calls: {array}")
    if mode == "required":
        return f"{trigger} calls"
    if mode == "auto":
        if _is_special(trigger):
            return f"TEXT ({trigger} calls)?"
        rules.append(f"hd[lazy]: TEXT {trigger}")
        return "TEXT | hd calls"
    return _text_without(trigger, rules)


def _text_without(trigger: str, rules: list[str]) -> str:
    """Any text in which the trigger cannot occur (`none`)."""
    if _is_special(trigger):
        return "TEXT"  # special tokens are never text
    rules.append(f"TRIGGERED: /(?s:.*)/ {trigger} /(?s:.*)/")
    rules.append("SAFE_TEXT: /(?s:.*)/ & ~TRIGGERED")
    return "SAFE_TEXT"
