"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, a JSON array after the `[TOOL_CALLS]` token
(v3 templates), and the v11 templates' `[TOOL_CALLS]name[ARGS]{...}`, one per call (`mistral_v11`).

Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when the call comes back in
the history (the next turn), so `call_<random>` would make that turn fail."""

from __future__ import annotations

import secrets

from wllm.entrypoints.openai.tool_parsers.base import _ALNUM, ToolCallParser
from wllm.structured.tools import ToolFormat

MISTRAL = ToolFormat("mistral", "array", trigger="[TOOL_CALLS]", separator=", ")
MISTRAL_V11 = ToolFormat("mistral_v11", "named", trigger="[TOOL_CALLS]", args_marker="[ARGS]")


class MistralToolParser(ToolCallParser):
    fmt = MISTRAL

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))


class MistralV11ToolParser(MistralToolParser):
    fmt = MISTRAL_V11
