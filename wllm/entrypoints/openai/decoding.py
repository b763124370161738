"""Strict request-body decoding: bounded nesting, no unknown fields, no type coercion.

Litestar decodes a JSON body to plain Python objects and then converts it to the handler's `data`
type with `msgspec.convert(..., strict=False)`, which turns `"10"` into `10`; and the untyped decode
recurses once per nesting level until CPython's recursion limit (a 500). `StrictRequest` replaces
`Request.json()`: it bounds the nesting depth and the number of values first, then decodes the body
straight into the handler's request Struct with `strict=True` (in a worker thread for a large body).
The Struct it returns passes through Litestar's own conversion unchanged. Every failure is a 400 with
an OpenAI error body.
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

# The most JSON values (counted as the commas between them, outside strings) a body may hold. Decoding
# holds the GIL for the whole body (from 0.1 us per integer to 1 us per message object), so this bounds
# how long one body keeps the event loop from running, worker thread or not. A prompt of 128K token ids
# is 128K values.
MAX_JSON_VALUES = 1 << 18

_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
# Bytes per pass of the scan: some numpy steps (fancy indexing, masked assignment) hold the GIL, so
# the scan of a large body is cut into pieces between which the event loop's thread gets to run.
_SCAN_CHUNK = 1 << 20


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `body` nests arrays/objects deeper than `limit`; brackets inside strings do not count."""
    return json_bounds_exceeded(body, limit, None) == "depth"


def json_bounds_exceeded(body: bytes, depth_limit: int = MAX_JSON_DEPTH, values_limit: int | None = MAX_JSON_VALUES,
                         chunk: int = _SCAN_CHUNK) -> str | None:
    """"depth" when `body` nests deeper than `depth_limit`, "values" when it has more than `values_limit`
    commas outside strings, else None.

    `bytes.count` calls decide for every usual request (no more opening brackets than the depth limit,
    no more commas than the values limit). Otherwise a vectorized pass (no Python loop per byte), in
    pieces of `chunk` bytes that carry the state across: find the quotes that are not escaped (an odd
    run of backslashes before a quote escapes it), mask the bytes inside strings, take the running
    bracket depth and count the commas. Invalid JSON gives some answer and then fails in the decoder,
    whose depth it has bounded all the same.
    """
    check_depth = body.count(b"[") + body.count(b"{") > depth_limit
    check_values = values_limit is not None and body.count(b",") > values_limit
    if not (check_depth or check_values):
        return None
    arr = np.frombuffer(body, dtype=np.uint8)
    depth = commas = 0
    inside = 0  # 1 while the previous piece ended inside a string
    carried = 0  # backslashes that ended the previous piece
    for begin in range(0, arr.size, chunk):
        a = arr[begin:begin + chunk]
        quotes = np.flatnonzero(a == _QUOTE)
        backslash = a == _BACKSLASH
        plain = np.flatnonzero(~backslash)
        if quotes.size and (carried or backslash.any()):
            index = np.int32 if a.size < 2**31 else np.int64  # half the temporaries of int64
            pos = np.arange(a.size, dtype=index)
            last_plain = np.maximum.accumulate(np.where(backslash, index(-1), pos))  # last non-backslash <= i
            before = np.maximum(quotes - 1, 0)
            lp = last_plain[before]
            run = np.where(quotes > 0, before - lp, 0)
            run += np.where((quotes == 0) | (lp < 0), carried, 0)  # a run from the piece's start continues
            quotes = quotes[run % 2 == 0]
        carried = a.size - 1 - int(plain[-1]) if plain.size else carried + a.size
        in_string = None
        if quotes.size or inside:
            toggles = np.zeros(a.size, dtype=np.int8)
            toggles[quotes] = 1
            in_string = ((np.cumsum(toggles, dtype=np.int32) + inside) & 1).astype(bool)
            inside = int(in_string[-1])
        if check_depth:
            steps = _DEPTH_STEP[a]
            if in_string is not None:
                steps[in_string] = 0
            running = np.cumsum(steps, dtype=np.int32)
            if depth + int(running.max()) > depth_limit:
                return "depth"
            depth += int(running[-1])
        if check_values:
            is_comma = a == _COMMA
            if in_string is not None:
                is_comma &= ~in_string
            commas += int(np.count_nonzero(is_comma))
            if commas > values_limit:  # type: ignore[operator]
                return "values"
    return None


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


def too_many_values() -> APIError:
    return APIError(400, f"Invalid request: the request body holds more than {MAX_JSON_VALUES} JSON values",
                    code="too_many_values")


def decode_body(body: bytes, type_: Any) -> Any:
    """Decode a JSON request body into `type_` (strictly); raises a 400 APIError on any problem."""
    exceeded = json_bounds_exceeded(body)
    if exceeded == "depth":
        raise too_deep()
    if exceeded == "values":
        raise too_many_values()
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
