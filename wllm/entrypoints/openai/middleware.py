"""Per-request observability: the access log line, request counters, the request span, token charges.

It wraps every routed HTTP request (Litestar applies app middleware after routing and outside the
exception handlers, so it sees the final status of error responses too). Handlers fill in the
`RequestRecord` it puts in the ASGI scope; it reads that record once the response is fully sent,
which for a stream is after `[DONE]` or the client's disconnect.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from litestar.datastructures import Headers
from litestar.middleware._internal.cors import CORSMiddleware
from litestar.response import Response
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from wllm.entrypoints.openai.errors import APIError, error_response
from wllm.entrypoints.openai.serving_common import STATE_KEY, RequestRecord, ServerContext

access_log = logging.getLogger("wllm.access")

# Paths that get their own metric label; anything else is "other" so scanners cannot blow up cardinality.
KNOWN_ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model_id:path}", "/tokenize",
    "/detokenize", "/health", "/metrics", "/version", "/openapi.json",
    "/v1/responses", "/v1/responses/{response_id:str}", "/v1/messages", "/v1/messages/count_tokens",
    "/chat/completions", "/completions", "/models", "/models/{model_id:path}",  # the routes without /v1
    "/responses", "/responses/{response_id:str}", "/messages", "/messages/count_tokens",
    "/v1/engine/stats", "/", "/ui/{name:str}",  # the web UI's stats and files
})
QUIET_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/engine/stats"})  # polled; logged at debug level only


def client_host(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.ctx
        start = time.monotonic()
        record = RequestRecord()
        record.arrival = start
        record.client = client_host(scope)
        scope.setdefault("state", {})[STATE_KEY] = record  # type: ignore[typeddict-item]
        template = scope.get("path_template") or scope["path"]
        endpoint = template if template in KNOWN_ENDPOINTS else "other"
        method = scope["method"]
        if ctx.tracer is not None and endpoint not in QUIET_ENDPOINTS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            record.span = ctx.tracer.start_request_span(
                f"{method} {endpoint}", headers,
                {"http.request.method": method, "url.path": scope["path"], "client.address": record.client})
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._done(record, method, scope["path"], endpoint, status, time.monotonic() - start)

    def _done(self, record: RequestRecord, method: str, path: str, endpoint: str, status: int,
              elapsed: float) -> None:
        ctx = self.ctx
        ctx.metrics.requests.labels(endpoint, str(status)).inc()
        ctx.prep.request_finished(record.body_bytes)
        used = record.prompt_tokens + record.completion_tokens
        if used:
            ctx.limiter.charge_tokens(record.key_id or record.client or "unknown", used)
        fields: dict[str, Any] = {"method": method, "path": path, "status": status, "client": record.client}
        fields.update(record.fields())
        fields["total_time_s"] = round(elapsed, 6)
        level = logging.DEBUG if endpoint in QUIET_ENDPOINTS and status < 400 else logging.INFO
        access_log.log(level, "%s %s %d", method, path, status, extra={"fields": fields})
        span = record.span
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if record.request_id:
                span.set_attributes({"wllm.request_id": record.request_id,
                                     "wllm.prompt_tokens": record.prompt_tokens,
                                     "wllm.cached_tokens": record.cached_tokens,
                                     "wllm.completion_tokens": record.completion_tokens})
            if status >= 500:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, record.error or f"HTTP {status}"))
            span.end()


class JSONErrorCORSMiddleware(CORSMiddleware):
    """Litestar's CORS middleware, except that a refused preflight gets an OpenAI error body.

    Litestar answers it `400 text/plain` "Disallowed CORS Origin"; clients that parse every error
    as `{"error": {...}}` choke on that. The status and the decision stay Litestar's.
    """

    def _create_preflight_response(self, origin: str, request_headers: Headers) -> Response[str | None]:
        response = super()._create_preflight_response(origin=origin, request_headers=request_headers)
        if response.status_code < 400:
            return response
        refused = str(response.content).removeprefix("Disallowed CORS ")
        return error_response(APIError(response.status_code,
                                       f"CORS preflight refused: disallowed {refused} (see --cors-origin).",
                                       code="cors_disallowed"))
