"""The streaming tool-call parser all formats share, driven by each format's `ToolFormat`.

It is fed the reply's text in whatever pieces the engine produces and returns events: content text, the start
of a call (index, id, name) and raw fragments of the call's arguments exactly as the model wrote them (never
re-serialised partial JSON). Its decisions depend only on the text, never on where the pieces were cut, so a
reply fed in one piece (a non-streamed response) gives exactly what its streamed deltas add up to.

Rules:
- Text that could still become a trigger (`<tool_ca`) is held back until it is known not to be one.
- A call is announced once its name is complete and is one of the request's tools; an unknown name, or an
  object that turns out to have no name, is not a call: its text is content.
- A call without arguments gets `{}`. A call cut short (the reply ended inside it) keeps the arguments text
  it had; the finish reason ("length") says why.
- Whitespace between content and a call is dropped; content itself is passed on unchanged.

Finding the arguments inside the call object needs only its bracket structure (strings, escapes, nesting),
which `_ObjectScan` tracks; validity is the grammar's business (wllm.structured.tools) and the client's
`json.loads`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Collection
from dataclasses import dataclass

from wllm.entrypoints.openai.text_edges import WS, hold_edge_ws
from wllm.structured.tools import ToolFormat

_NAME = re.compile(r"[A-Za-z0-9_-]*")
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolArgsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | ToolCallStart | ToolArgsDelta


def openai_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _ObjectScan:
    """Incremental scan of one JSON object in a growing buffer: where each top-level value starts and ends.

    `values[key] = (start, end)` for complete values; `open_key` / `open_start` for the value being read.
    `bad` is set when the text is not an object's structure (the caller then treats it as text)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.i = start + 1
        self.depth = 1
        self.in_str = False
        self.esc = False
        self.state = "key"  # key | in_key | colon | value | in_value | scalar | after
        self.key_start = 0
        self.key: str | None = None
        self.open_key: str | None = None
        self.open_start = 0
        self.values: dict[str, tuple[int, int]] = {}
        self.done = False
        self.bad = False
        self.end = 0

    def _close_value(self, end: int) -> None:
        if self.open_key is not None and self.open_key not in self.values:
            self.values[self.open_key] = (self.open_start, end)
        self.open_key = None
        self.state = "after"

    def advance(self, buf: str) -> None:
        i, n = self.i, len(buf)
        while i < n and not self.done:
            c = buf[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1 and self.state == "in_key":
                        try:
                            self.key = json.loads(buf[self.key_start : i + 1])
                        except ValueError:
                            self.key = None
                        self.state = "colon"
                    elif self.depth == 1 and self.state == "in_value":
                        self._close_value(i + 1)
                i += 1
                continue
            if self.depth > 1:
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 1:
                        self._close_value(i + 1)
                i += 1
                continue
            state = self.state
            if state == "scalar":
                if c in WS or c in ",}":
                    self._close_value(i)
                    continue  # the same character again, after the value
                i += 1
                continue
            if c in WS:
                i += 1
                continue
            if state == "key":
                if c == '"':
                    self.in_str, self.state, self.key_start = True, "in_key", i
                elif c == "}":
                    self.done, self.end = True, i + 1
                else:
                    self.done, self.bad = True, True
                    break
            elif state == "colon":
                if c == ":":
                    self.state = "value"
                else:
                    self.done, self.bad = True, True
                    break
            elif state == "value":
                self.open_key = self.key if isinstance(self.key, str) else None
                self.open_start = i
                if c == '"':
                    self.in_str, self.state = True, "in_value"
                elif c in "{[":
                    self.depth, self.state = 2, "in_value"
                elif c in ",}]:":
                    self.done, self.bad = True, True
                    break
                else:
                    self.state = "scalar"
            elif state == "after":
                if c == ",":
                    self.state = "key"
                elif c == "}":
                    self.done, self.end = True, i + 1
                else:
                    self.done, self.bad = True, True
                    break
            i += 1
        self.i = i


class ToolCallParser:
    """Turns one reply's text into content and OpenAI tool calls, incrementally (see the module doc)."""

    fmt: ToolFormat

    def __init__(self, tool_names: Collection[str], fmt: ToolFormat | None = None) -> None:
        if fmt is not None:
            self.fmt = fmt
        self.tool_names = frozenset(tool_names)
        self.buf = ""
        self.pos = 0  # everything before has been decided
        self.mode = "content"  # content | lead | elements | object | after | text
        self.started = False  # a non-whitespace character of the reply has been seen (bare layout)
        self.region = 0  # where the text of the call being read began (its trigger included)
        self.scan: _ObjectScan | None = None
        self.pending_ws = ""
        self.region_ws = ""  # whitespace held before the trigger, given back if it was not a call
        self.skip_ws = False  # after a call: whitespace before the next text is dropped
        self.calls = 0
        self._announced = False
        self._args_from = 0
        self._args_done = False

    def new_call_id(self) -> str:
        return openai_call_id()

    # ---------------------------------------------------------------- public

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        out: list[ToolEvent] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._run(out, final=True)
        if (self.mode == "object" and not self._announced) or (self.mode in ("lead", "elements") and self.calls == 0):
            self._not_a_call(out, len(self.buf))  # the reply ended before this became a call
        elif self.mode == "args":
            out.append(ToolArgsDelta(self.calls - 1, "{}"))  # named layout: a name and no arguments
        if self.mode in ("content", "text"):
            self._content(out, self.buf[self.pos :])
            if self.pending_ws and not self.skip_ws:
                out.append(ContentDelta(self.pending_ws))
        self.pending_ws = ""
        self.pos = len(self.buf)
        return out

    # ---------------------------------------------------------------- internals

    def _content(self, out: list[ToolEvent], text: str) -> None:
        """Content text, holding back trailing whitespace (it is dropped if a call follows)."""
        emit, self.skip_ws, self.pending_ws = hold_edge_ws(text, self.skip_ws, self.pending_ws)
        if emit:
            out.append(ContentDelta(emit))

    def _start_region(self, region: int) -> None:
        self.region = region
        self.region_ws, self.pending_ws = self.pending_ws, ""

    def _run(self, out: list[ToolEvent], final: bool) -> None:
        fmt, buf = self.fmt, self.buf
        while True:
            mode, n = self.mode, len(buf)
            if mode == "text":
                self._content(out, buf[self.pos :])
                self.pos = n
                return
            if mode == "content":
                if fmt.layout == "bare" and not self.started and self.calls == 0:
                    j = self.pos
                    while j < n and buf[j] in WS:
                        j += 1
                    if j == n:
                        return  # only whitespace so far: may still become a call
                    self.started = True
                    if buf[j] == "{":
                        self._start_region(self.pos)
                        self.pos, self.mode = j, "lead"
                        continue
                trigger = fmt.trigger
                if not trigger:
                    self._content(out, buf[self.pos :])
                    self.pos = n
                    return
                k = buf.find(trigger, self.pos)
                if k >= 0:
                    self._content(out, buf[self.pos : k])
                    self._start_region(k)
                    self.pos, self.mode = k + len(trigger), "name" if fmt.layout == "named" else "lead"
                    continue
                hold = 0 if final else _partial_suffix(buf, self.pos, trigger)
                self._content(out, buf[self.pos : n - hold])
                self.pos = n - hold
                return
            if mode == "name":  # named layout: the function's name, up to the arguments marker
                marker = fmt.args_marker
                k = buf.find(marker, self.pos)
                if k < 0:
                    hold = 0 if final else _partial_suffix(buf, self.pos, marker)
                    if not final and _NAME.fullmatch(buf[self.pos : n - hold].strip(WS)):
                        return  # the name so far
                    self._not_a_call(out, self.pos)
                    continue
                name = buf[self.pos : k].strip(WS)
                if name not in self.tool_names:
                    self._not_a_call(out, self.pos)
                    continue
                self._announce(out, name)
                self.pos, self.mode = k + len(marker), "args"
                continue
            if mode == "args":  # named layout: the arguments object
                j = self.pos
                while j < n and buf[j] in WS:
                    j += 1
                if j == n:
                    return
                if buf[j] != "{":
                    out.append(ToolArgsDelta(self.calls - 1, "{}"))
                    self._end_calls(j)
                    continue
                self.scan, self.mode, self.pos = _ObjectScan(j), "object", j
                self._args_from, self._args_done = j, False
                continue
            if mode in ("lead", "elements", "after"):
                j = self.pos
                while j < n and buf[j] in WS:
                    j += 1
                if j == n:
                    return
                c = buf[j]
                if mode == "lead" and fmt.layout == "array" and c == "[":
                    self.pos, self.mode = j + 1, "elements"
                    continue
                if mode in ("lead", "elements") and c == "{":
                    self._begin_object(j)
                    continue
                if mode == "elements" and c == "]":
                    self._end_calls(j + 1)
                    continue
                if mode == "after":
                    if fmt.layout == "tagged":
                        close = fmt.call_close.strip(WS)
                        if buf.startswith(close, j):
                            self._end_calls(j + len(close))
                            continue
                        if not final and close.startswith(buf[j:]):
                            return  # maybe the closing tag
                        self._end_calls(j)
                        continue
                    if fmt.layout == "array":
                        if c == ",":
                            self.pos, self.mode = j + 1, "elements"
                            continue
                        self._end_calls(j + 1 if c == "]" else j)
                        continue
                    # bare: the separator, then another call or the end of the calls
                    sep = fmt.separator.strip(WS)
                    if sep and buf.startswith(sep, j):
                        self.pos, self.mode = j + len(sep), "lead"
                        continue
                    if not final and sep and sep.startswith(buf[j:]):
                        return
                    if c == "{":
                        self._begin_object(j)
                        continue
                    self._end_calls(j)
                    self.mode = "text"
                    continue
                if self.calls == 0 or (fmt.layout == "tagged" and mode == "lead"):
                    self._not_a_call(out, j)  # not a call after all: its text is content
                else:
                    self._end_calls(j)  # the calls are over (malformed): the rest is text
                    self.mode = "text"
                continue
            # object
            scan = self.scan
            assert scan is not None
            scan.advance(buf)
            if fmt.layout == "named":  # the object is the arguments: hand it on as it comes
                stop = scan.end if scan.done and not scan.bad else scan.i
                if stop > self._args_from:
                    out.append(ToolArgsDelta(self.calls - 1, buf[self._args_from : stop]))
                    self._args_from = stop
                if not scan.done:
                    return
                self.scan = None
                self._end_calls(stop)
                continue
            self._emit_call(out, scan)
            if not scan.done:
                return
            if not self._announced:
                self._not_a_call(out, scan.i if scan.bad else scan.end)
                continue
            if not self._args_done:
                self._finish_args(out, scan)
            if scan.bad:  # the call was announced, then its object broke off: the rest is text
                self._end_calls(scan.i)
                self.mode, self.scan = "text", None
                continue
            self.pos, self.mode, self.scan = scan.end, "after", None

    def _begin_object(self, j: int) -> None:
        if self.fmt.layout != "tagged" and self.calls > 0:
            self.region = j  # a later element: only its own text would become content
        self.scan = _ObjectScan(j)
        self.mode = "object"
        self.pos = j
        self._announced = False
        self._args_done = False

    def _end_calls(self, end: int) -> None:
        self.pos, self.mode, self.skip_ws = end, "content", True
        if self.fmt.layout == "bare":
            self.mode = "text"

    def _not_a_call(self, out: list[ToolEvent], upto: int) -> None:
        """The region read since the trigger is text; go on reading text after it."""
        self.pending_ws, self.region_ws = self.region_ws + self.pending_ws, ""
        self._content(out, self.buf[self.region : upto])
        self.pos, self.scan = upto, None
        self.mode = "text" if self.fmt.layout == "bare" else "content"
        if self.fmt.layout == "array" and self.calls:
            self.mode = "text"

    def _emit_call(self, out: list[ToolEvent], scan: _ObjectScan) -> None:
        if not self._announced:
            span = scan.values.get("name")
            if span is None:
                return
            try:
                name = json.loads(self.buf[span[0] : span[1]])
            except ValueError:
                name = None
            if not isinstance(name, str) or name not in self.tool_names:
                scan.done, scan.bad = True, True  # not one of the request's tools: text
                scan.i = len(self.buf)
                return
            self._announce(out, name)
            self._args_from = -1
        if self._args_done:
            return
        key, start, end = self._args_span(scan)
        if key is None:
            return
        if self._args_from < 0:
            self._args_from = start
        first = self.buf[start]
        if first == '"':
            # Arguments sent as a JSON string: hand on the string's content once it is complete.
            if end is not None:
                try:
                    value = json.loads(self.buf[start:end])
                except ValueError:
                    value = self.buf[start:end]
                out.append(ToolArgsDelta(self.calls - 1, value if isinstance(value, str) else json.dumps(value)))
                self._args_done = True
            return
        stop = end if end is not None else scan.i
        if stop > self._args_from:
            out.append(ToolArgsDelta(self.calls - 1, self.buf[self._args_from : stop]))
            self._args_from = stop
        if end is not None:
            self._args_done = True

    def _announce(self, out: list[ToolEvent], name: str) -> None:
        self._announced = True
        out.append(ToolCallStart(self.calls, self.new_call_id(), name))
        self.calls += 1

    def _args_span(self, scan: _ObjectScan) -> tuple[str | None, int, int | None]:
        for key in self.fmt.args_keys:
            if key in scan.values:
                start, end = scan.values[key]
                return key, start, end
        if scan.open_key in self.fmt.args_keys and scan.state in ("in_value", "scalar"):
            return scan.open_key, scan.open_start, None
        return None, 0, None

    def _finish_args(self, out: list[ToolEvent], scan: _ObjectScan) -> None:
        key, _, _ = self._args_span(scan)
        if key is None:
            out.append(ToolArgsDelta(self.calls - 1, "{}"))
        self._args_done = True


def _partial_suffix(buf: str, start: int, trigger: str) -> int:
    """Length of the longest tail of buf[start:] that is a proper prefix of `trigger`."""
    for k in range(min(len(trigger) - 1, len(buf) - start), 0, -1):
        if buf.endswith(trigger[:k]):
            return k
    return 0
