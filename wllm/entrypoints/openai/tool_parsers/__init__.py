"""Tool-call parsers, one module per model family's format, and the choice of format for a chat template.

`detect_tool_format(template)` reads the template's own markers; `--tool-call-parser` overrides it. Every
parser turns a reply's text (whole or streamed) into content and OpenAI `tool_calls`; see `base`.
"""

from __future__ import annotations

import re

from wllm.entrypoints.openai.tool_parsers.base import (
    ContentDelta,
    ToolArgsDelta,
    ToolCallParser,
    ToolCallStart,
    ToolEvent,
)
from wllm.entrypoints.openai.tool_parsers.generic import GENERIC, GenericToolParser
from wllm.entrypoints.openai.tool_parsers.hermes import HERMES, HermesToolParser
from wllm.entrypoints.openai.tool_parsers.llama3_json import LLAMA3_JSON, Llama3JsonToolParser
from wllm.entrypoints.openai.tool_parsers.mistral import MISTRAL, MISTRAL_V11, MistralToolParser, MistralV11ToolParser
from wllm.structured.tools import ToolFormat

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "mistral_v11": MistralV11ToolParser,
    "generic": GenericToolParser,
}
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, GENERIC)}
# What --tool-call-parser accepts.
TOOL_PARSER_CHOICES = ("auto", *PARSERS)

_USES_TOOLS = re.compile(r"\btools\b")


def detect_tool_format(template: str | None) -> str:
    """The tool-call format a chat template renders for, from the markers in its text.

    A template that never reads `tools`, or reads them without a format this server knows, gets the generic
    format (the tools are then described in a system message instead of by the template)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral_v11" if "[ARGS]" in t else "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t and _USES_TOOLS.search(t)):
        return "llama3_json"
    return "generic"


__all__ = [
    "FORMATS",
    "PARSERS",
    "TOOL_PARSER_CHOICES",
    "ContentDelta",
    "ToolArgsDelta",
    "ToolCallParser",
    "ToolCallStart",
    "ToolEvent",
    "detect_tool_format",
]
