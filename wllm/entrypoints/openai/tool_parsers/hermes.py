"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call,
text before them allowed."""

from __future__ import annotations

from wllm.entrypoints.openai.tool_parsers.base import ToolCallParser
from wllm.structured.tools import ToolFormat

HERMES = ToolFormat(
    "hermes", "tagged", trigger="<tool_call>", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n"
)


class HermesToolParser(ToolCallParser):
    fmt = HERMES
