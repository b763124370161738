"""Whitespace at the edges of a streamed region (reasoning, content around tool calls) is layout: held back
until text follows it, and dropped at the start of a region."""

from __future__ import annotations

WS = " \t\r\n"


def hold_edge_ws(text: str, skip: bool, pending: str) -> tuple[str | None, bool, str]:
    """One piece of a region's text -> (what to emit now or None, skip, pending): leading whitespace is dropped
    while `skip`, trailing whitespace waits in `pending` and goes out before the next text."""
    if skip:
        text = text.lstrip(WS)
        if not text:
            return None, True, pending
        skip = False
    body = text.rstrip(WS)
    if not body:
        return None, skip, pending + text
    return pending + body, skip, text[len(body) :]
