"""The fallback for chat templates that know no tools (SmolLM2, ...): the tools and the call format are described
in a system message, and a call is the whole reply: JSON objects `{"name": ..., "arguments": {...}}`, one per
line. Tool calls in the history are written back into the assistant turn the same way, so the model sees
its own earlier calls."""

from __future__ import annotations

import json
from typing import Any

from wllm.entrypoints.openai.tool_parsers.base import ToolCallParser
from wllm.structured.tools import ToolFormat

GENERIC = ToolFormat("generic", "bare", separator="\n")


class GenericToolParser(ToolCallParser):
    fmt = GENERIC


def tool_instructions(tools: list[dict[str, Any]], mode: str, named: str | None, parallel: bool) -> str:
    """The system-message text that describes the tools and how to call them."""
    specs = [{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")} for t in tools]
    lines = [
        "You can call functions. These are available (JSON):",
        json.dumps(specs, ensure_ascii=False),
        'To call a function, reply with only a JSON object {"name": <function name>, "arguments": <an object '
        "with the function's arguments>}" + (", one per line for several calls." if parallel else "."),
    ]
    if named is not None:
        lines.append(f"Call the function {named} now.")
    elif mode == "required":
        lines.append("You must call a function now.")
    else:
        lines.append("If no function is needed, answer in plain text instead.")
    return "\n".join(lines)


def calls_as_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's tool calls, written the way this format asks the model to write them."""
    out = []
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            args = json.loads(args)
        out.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
    return "\n".join(out)
