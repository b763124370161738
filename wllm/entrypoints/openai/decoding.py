"""Strict request-body decoding: bounded nesting, no unknown fields, no type coercion.

Litestar decodes a JSON body to plain Python objects and then converts it to the handler's `data`
type with `msgspec.convert(..., strict=False)`, which turns `"10"` into `10`; and the untyped decode
recurses once per nesting level until CPython's recursion limit (a 500). `StrictRequest` replaces
`Request.json()`: it bounds the nesting depth first, then decodes the body straight into the
handler's request Struct with `strict=True`. The Struct it returns passes through Litestar's own
conversion unchanged. Every failure is a 400 with an OpenAI error body.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np
from litestar import Request
from litestar.exceptions import InternalServerException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import Empty

from wllm.entrypoints.openai.errors import APIError, upload_timeout
from wllm.entrypoints.openai.serving_common import (
    STATE_KEY,
    UPLOAD_TIMEOUT_KEY,
    ClientDisconnected,
    RequestRecord,
    ServerContext,
)

# The deepest JSON nesting (arrays and objects together) a request body may have. The deepest real
# request is a chat message with content parts or a tool call with JSON-schema parameters, about a
# dozen levels; 128 leaves room for any tool schema while staying far below CPython's recursion
# limit (~1000), where msgspec's decoder gives up with a RecursionError.
MAX_JSON_DEPTH = 128

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests arrays/objects deeper than `limit`; brackets inside strings do not count.

    Two `bytes.count` calls for a body with at most `limit` opening brackets (every usual request);
    otherwise one vectorized pass (linear, no Python loop per byte): find the quotes that are not
    escaped (an odd run of backslashes before a quote escapes it), mask the bytes inside strings,
    and take the maximum of the running bracket depth. Invalid JSON gives some answer and then
    fails in the decoder, whose depth it has bounded all the same.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    arr = np.frombuffer(body, dtype=np.uint8)
    steps = _DEPTH_STEP[arr]
    quotes = np.flatnonzero(arr == _QUOTE)
    if quotes.size:
        backslash = arr == _BACKSLASH
        if backslash.any() and quotes[-1] > 0:
            index = np.int32 if arr.size < 2**31 else np.int64  # half the temporaries of int64
            pos = np.arange(arr.size, dtype=index)
            last_plain = np.maximum.accumulate(np.where(backslash, index(-1), pos))  # last non-backslash <= i
            before = quotes - 1
            run = np.where(quotes > 0, before - last_plain[np.maximum(before, 0)], 0)
            quotes = quotes[run % 2 == 0]
        toggles = np.zeros(arr.size, dtype=np.int8)
        toggles[quotes] = 1
        inside = (np.cumsum(toggles, dtype=np.int32) & 1).astype(bool)
        steps[inside] = 0
    return int(np.cumsum(steps, dtype=np.int32).max()) > limit


def too_deep() -> APIError:
    return APIError(400, f"Invalid request: the request body nests deeper than {MAX_JSON_DEPTH} levels "
                         "of arrays and objects", code="nesting_too_deep")


_AT = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`")


def validation_error(exc: msgspec.ValidationError) -> APIError:
    """A 400 from msgspec's message, with `param` set to the offending field's path."""
    text = str(exc)
    m = _AT.search(text)
    where = m.group(1) if m else ""
    base = text[: m.start()] if m else text
    unknown = _UNKNOWN.match(base)
    if unknown:
        name = unknown.group(1)
        param = f"{where}.{name}" if where else name
        return APIError(400, f"Invalid request: unknown field `{param}`: this server does not support it "
                             "(fields it does not implement are refused, not ignored)",
                        param=param, code="unknown_field")
    return APIError(400, f"Invalid request: {text}", param=where or None)


def decode_body(body: bytes, type_: Any) -> Any:
    """Decode a JSON request body into `type_` (strictly); raises a 400 APIError on any problem."""
    if json_depth_exceeds(body):
        raise too_deep()
    try:
        return msgspec.json.decode(body or b"null", type=type_, strict=True)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"Invalid request: the body is not valid JSON ({exc})") from None
    except RecursionError:  # cannot happen below MAX_JSON_DEPTH; a 400 all the same
        raise too_deep() from None


class StrictRequest(Request[Any, Any, Any]):
    """`Request` whose `json()` is `decode_body` into the handler's `data` type (or `Any`), off the event
    loop for a large body, and whose `body()` tells an abandoned upload (499) and a timed-out one (408)
    from a server error (Litestar raises a 500 for both)."""

    def _record(self) -> RequestRecord | None:
        return self.scope.get("state", {}).get(STATE_KEY)

    async def body(self) -> bytes:
        try:
            body = await super().body()
        except RequestEntityTooLarge:
            if (record := self._record()) is not None:  # what was read of it is freed memory to give back
                record.body_bytes = max(record.body_bytes, self.route_handler.resolve_request_max_body_size() or 0)
            raise
        except InternalServerException as exc:
            timeout = self.scope.get("state", {}).get(UPLOAD_TIMEOUT_KEY)
            if timeout is not None:
                raise upload_timeout(timeout) from None
            if "disconnect" in str(exc.detail):  # the client went away mid-upload
                raise ClientDisconnected() from None
            raise
        if (record := self._record()) is not None:
            record.body_bytes = len(body)
        return body

    async def json(self) -> Any:
        if self._json is Empty:
            if (cached := self._connection_state.json) is not Empty:
                self._json = cached
            else:
                data = self.route_handler.parsed_fn_signature.parameters.get("data")
                type_ = data.annotation if data is not None else Any
                body = await self.body()
                ctx: ServerContext | None = self.app.state.get("server")
                if ctx is not None:
                    decoded = await ctx.prep.run(len(body), decode_body, body, type_)
                else:
                    decoded = decode_body(body, type_)
                self._json = self._connection_state.json = decoded
        return self._json
