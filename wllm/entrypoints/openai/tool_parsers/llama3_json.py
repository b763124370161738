"""Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}` (several separated
by `;`), optionally after the `<|python_tag|>` token. Llama models also write `arguments` for `parameters`,
and the parser reads both; grammars write `parameters`, as the Llama templates document."""

from __future__ import annotations

from wllm.entrypoints.openai.tool_parsers.base import ToolCallParser
from wllm.structured.tools import ToolFormat

LLAMA3_JSON = ToolFormat(
    "llama3_json", "bare", trigger="<|python_tag|>", separator="; ", args_keys=("parameters", "arguments")
)


class Llama3JsonToolParser(ToolCallParser):
    fmt = LLAMA3_JSON
