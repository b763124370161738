"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, a JSON array after the `[TOOL_CALLS]` token.

Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when the call comes back in
the history (the next turn), so `call_<random>` would make that turn fail."""

from __future__ import annotations

import secrets

from wllm.entrypoints.openai.tool_parsers.base import _ALNUM, ToolCallParser
from wllm.structured.tools import ToolFormat

MISTRAL = ToolFormat("mistral", "array", trigger="[TOOL_CALLS]", separator=", ")


class MistralToolParser(ToolCallParser):
    fmt = MISTRAL

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
