"""Server-sent events framing, byte for byte as OpenAI (and Anthropic) send it.

Each event is `data: <compact JSON>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. msgspec's
JSON never contains a raw newline, so one `data:` line per event is always enough.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell nginx-style proxies not to buffer the stream.
    "X-Accel-Buffering": "no",
}


def sse_event(payload: Any) -> bytes:
    """One `data:` event carrying `payload` encoded as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def sse_typed_event(event: str, payload: Any) -> bytes:
    """One `event: <type>` + `data:` event, as the Responses and Anthropic Messages streams send them."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"
