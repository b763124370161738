"""Reasoning output (Qwen3, QwQ, DeepSeek-R1 style `<think>...</think>`): thinking text goes to
`reasoning_content`, the rest to the reply's content.

The reply is in its thinking from the start when the prompt ends inside an open `<think>` (templates that
write it into the generation prompt), or once the model writes `<think>` as its first text. The text up to
`</think>` is reasoning; what follows is content (and may hold tool calls). Like the tool-call parser, the
splitter holds back text that could still become a marker, so streamed and whole replies split the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from wllm.entrypoints.openai.text_edges import WS, hold_edge_ws
from wllm.entrypoints.openai.tool_parsers.base import ContentDelta, _partial_suffix

# What --reasoning-parser accepts; the named ones all read <think>...</think>.
REASONING_PARSER_CHOICES = ("auto", "none", "qwen3", "deepseek_r1")
_THINK = ("<think>", "</think>")


@dataclass
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = _THINK[0]
    end: str = _THINK[1]


def detect_reasoning(template: str | None) -> ReasoningFormat | None:
    """A `<think>` reasoning model's template writes (or strips) both markers."""
    t = template or ""
    return ReasoningFormat() if _THINK[0] in t and _THINK[1] in t else None


def reasoning_format(choice: str, template: str | None) -> ReasoningFormat | None:
    """The reasoning format for `--reasoning-parser` (auto: from the chat template)."""
    if choice == "none":
        return None
    if choice == "auto":
        return detect_reasoning(template)
    return ReasoningFormat()


def prompt_opens_reasoning(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether the rendered prompt ends inside a thinking block (its last start marker is not closed)."""
    start = prompt.rfind(fmt.start)
    return start >= 0 and prompt.find(fmt.end, start) < 0


def prompt_closes_reasoning(prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether the prompt ends with a finished (typically empty) thinking block: thinking is off."""
    return bool(re.search(re.escape(fmt.end) + r"\s*\Z", prompt))


class ReasoningParser:
    """Splits one reply into reasoning and content, incrementally."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool = False, allow_start: bool = True) -> None:
        self.fmt = fmt
        self.buf = ""
        self.pos = 0
        # start: the model may still open a block | reasoning | content
        self.mode = "reasoning" if in_reasoning else ("start" if allow_start else "content")
        self.skip_ws = in_reasoning
        self.pending_ws = ""

    def feed(self, text: str) -> list[ReasoningDelta | ContentDelta]:
        self.buf += text
        out: list[ReasoningDelta | ContentDelta] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[ReasoningDelta | ContentDelta]:
        out: list[ReasoningDelta | ContentDelta] = []
        self._run(out, final=True)
        return out

    def _reasoning(self, out: list[ReasoningDelta | ContentDelta], text: str) -> None:
        # Whitespace at the block's edges is layout, not reasoning.
        emit, self.skip_ws, self.pending_ws = hold_edge_ws(text, self.skip_ws, self.pending_ws)
        if emit:
            out.append(ReasoningDelta(emit))

    def _run(self, out: list[ReasoningDelta | ContentDelta], final: bool) -> None:
        fmt, buf = self.fmt, self.buf
        while True:
            rest = buf[self.pos :]
            if self.mode == "start":
                lead = rest.lstrip(WS)
                if lead.startswith(fmt.start):
                    self.pos += len(rest) - len(lead) + len(fmt.start)
                    self.mode, self.skip_ws = "reasoning", True
                    continue
                if not final and fmt.start.startswith(lead):
                    return  # empty, or the start marker so far
                self.mode = "content"
                continue
            if self.mode == "reasoning":
                k = buf.find(fmt.end, self.pos)
                if k >= 0:
                    self._reasoning(out, buf[self.pos : k])
                    self.pending_ws = ""
                    self.pos, self.mode = k + len(fmt.end), "after"
                    continue
                hold = 0 if final else _partial_suffix(buf, self.pos, fmt.end)
                self._reasoning(out, buf[self.pos : len(buf) - hold])
                self.pos = len(buf) - hold
                if final and self.pending_ws:
                    self.pending_ws = ""
                return
            if self.mode == "after":
                lead = rest.lstrip(WS)
                if not lead and not final:
                    return  # whitespace after the block is layout: wait for the content
                self.pos = len(buf) - len(lead)
                self.mode = "content"
                continue
            if rest:
                out.append(ContentDelta(rest))
            self.pos = len(buf)
            return
