"""Connection-level limits that uvicorn lacks: header and body-upload timeouts, an idle timeout from the
first byte, a cap on header bytes and on open connections.

uvicorn times out a keep-alive connection only after a response, so a client that connects and sends
nothing, trickles its headers or trickles its body holds a connection (and a request task) forever,
before auth sees it. `guarded_protocol(base, limits)` subclasses one of uvicorn's HTTP protocols
(httptools or h11; both keep the request being read in `self.cycle`) with a per-connection watchdog:

- idle (no byte of a request yet): closed after `keep_alive_timeout` seconds, silently;
- headers: they must be complete `header_timeout` seconds after their first byte, and at most
  `max_header_bytes` long; else a 408 / 431 with an OpenAI error body, and the connection is closed;
- body: it must have arrived `body_timeout` seconds after the headers; else a 408, the connection is
  closed, and the app (which is waiting for the body) ends the request as a 408 too, so the access log
  and `wllm_requests_total` count it as one (a client that goes away mid-upload is a 499 there);
- over `max_connections` open connections, a new one first makes room by closing the connection that
  has been idle (or sending headers) longest; if every connection has a request in progress, the
  new one is answered 503 with Retry-After and closed.

Everything runs in the protocol's callbacks on the event loop (timers, no threads, no signals), the
same on Windows and Linux.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from wllm.entrypoints.openai.errors import APIError, upload_timeout
from wllm.entrypoints.openai.serving_common import UPLOAD_TIMEOUT_KEY

logger = logging.getLogger("wllm.server")


@dataclass(frozen=True)
class ConnectionLimits:
    """Timeouts in seconds, sizes in bytes; the defaults are `wllm serve`'s."""

    keep_alive_timeout: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 1024

    def validate(self) -> None:
        for name in ("keep_alive_timeout", "header_timeout", "body_timeout", "max_header_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


# Where a connection is: waiting for a request, reading its headers, reading its body, serving it,
# skipping the rest of a body the app answered without reading, or closing after an error of ours.
IDLE, HEADERS, BODY, BUSY, DRAIN, CLOSING = "idle", "headers", "body", "busy", "drain", "closing"
# After writing an error, how long the connection still reads (and drops) what the client sends before it
# closes: closing a socket with unread input makes the kernel send a reset, which can destroy the error
# response before the client has read it (nginx's "lingering close").
LINGER_S = 2.0


def raw_error(err: APIError, extra_headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with `err`'s OpenAI body and `connection: close`, for the protocol to write
    itself (before or instead of the app)."""
    body = msgspec.json.encode(err.body())
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
        **(extra_headers or {}),
    }
    head = f"HTTP/1.1 {err.status_code} {http.HTTPStatus(err.status_code).phrase}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


def default_http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's `http="auto"`: httptools when it imports (a dependency), h11 otherwise."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def guarded_protocol(
    base: type[asyncio.Protocol], limits: ConnectionLimits, on_close: Callable[[str], None] | None = None
) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HttpToolsProtocol or H11Protocol) with the watchdog above; pass the result as
    uvicorn's `http=`. `on_close(reason)` is told of each connection the watchdog ends early."""
    limits.validate()
    note = on_close or (lambda reason: None)

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        _wd_phase = IDLE
        _wd_timer: asyncio.TimerHandle | None = None
        _wd_since = 0.0
        _wd_header_bytes = 0

        # -- uvicorn's protocol interface

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._wd_enter(IDLE, limits.keep_alive_timeout, self._wd_idle_expired)
            if len(self.connections) > limits.max_connections and not self._wd_make_room():
                note("over_capacity")
                self._wd_close(
                    APIError(
                        503,
                        f"The server has {limits.max_connections} connections open, all "
                        "busy (--max-connections); retry shortly.",
                        type="service_unavailable_error",
                        code="too_many_connections",
                    ),
                    {"retry-after": "1"},
                )

        def connection_lost(self, exc: Exception | None) -> None:
            self._wd_cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._wd_phase == CLOSING:
                return  # an error was sent; what the client still sends is dropped
            if self._wd_phase == IDLE:
                self._wd_header_bytes = 0
                self._wd_enter(HEADERS, limits.header_timeout, self._wd_header_expired)
            if self._wd_phase == HEADERS:
                self._wd_header_bytes += len(data)
            before = self.cycle
            super().data_received(data)
            if self.transport is None or self.transport.is_closing():
                self._wd_cancel()
                return
            cycle = self.cycle
            if cycle is not None and cycle is not before:  # a request's headers are complete
                if cycle.more_body:
                    self._wd_enter(BODY, limits.body_timeout, self._wd_body_expired)
                else:
                    self._wd_enter(BUSY)
            elif self._wd_phase == HEADERS and self._wd_header_bytes > limits.max_header_bytes:
                note("headers_too_large")
                self._wd_close(
                    APIError(
                        431,
                        f"The request headers are larger than {limits.max_header_bytes} bytes (--max-header-size).",
                        code="headers_too_large",
                    )
                )
            elif self._wd_phase == BODY and cycle is not None and not cycle.more_body:
                self._wd_enter(BUSY)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport is None or self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a pipelined request started in its place (data_received saw its headers)
            if cycle is not None and cycle.more_body and self._wd_phase == BODY:
                # Answered before its body was read (e.g. a 401): the rest of the body may still come, within
                # the body deadline; it is not counted as headers.
                self._wd_phase = DRAIN
                return
            self._wd_enter(IDLE, limits.keep_alive_timeout, self._wd_idle_expired)

        # -- the watchdog

        def _wd_enter(
            self, phase: str, timeout: float | None = None, expired: Callable[[], None] | None = None
        ) -> None:
            self._wd_cancel()
            self._wd_phase = phase
            self._wd_since = self.loop.time()
            if timeout is not None and expired is not None:
                self._wd_timer = self.loop.call_later(timeout, expired)

        def _wd_cancel(self) -> None:
            if self._wd_timer is not None:
                self._wd_timer.cancel()
                self._wd_timer = None

        def _wd_close(self, err: APIError | None = None, extra_headers: dict[str, str] | None = None) -> None:
            self._wd_cancel()
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            if err is None:
                transport.close()
                return
            transport.write(raw_error(err, extra_headers))
            self._wd_phase = CLOSING
            if transport.can_write_eof():  # not over TLS
                transport.write_eof()  # the client reads the response, then its end of file
                self._wd_timer = self.loop.call_later(LINGER_S, transport.close)
            else:
                transport.close()

        def _wd_idle_expired(self) -> None:
            self._wd_timer = None
            self._wd_close()

        def _wd_header_expired(self) -> None:
            self._wd_timer = None
            note("header_timeout")
            self._wd_close(
                APIError(
                    408,
                    f"The request headers did not arrive within {limits.header_timeout:g} s "
                    "(--timeout-header); the connection is closed.",
                    code="request_timeout",
                )
            )

        def _wd_body_expired(self) -> None:
            self._wd_timer = None
            cycle = self.cycle
            if self._wd_phase == DRAIN or cycle is None or cycle.response_started:
                self._wd_close()  # a response went out already: nothing more to say
                return
            note("body_timeout")
            # The app is waiting for the body: it reads this flag when told the client is gone, and ends the
            # request as a 408 in its own log and metrics (its response goes nowhere: the client gets this one).
            cycle.scope.setdefault("state", {})[UPLOAD_TIMEOUT_KEY] = limits.body_timeout
            self._wd_close(upload_timeout(limits.body_timeout))
            cycle.disconnected = True
            cycle.message_event.set()

        def _wd_make_room(self) -> bool:
            """Close the connection that has waited longest without a request in progress; False if none."""
            victims = [
                c
                for c in self.connections
                if c is not self and isinstance(c, GuardedProtocol) and c._wd_phase in (IDLE, HEADERS)
            ]
            if not victims:
                return False
            oldest = min(victims, key=lambda c: (c._wd_phase != IDLE, c._wd_since))  # idle ones first
            note("evicted_" + oldest._wd_phase)
            oldest._wd_close()
            return True

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol
