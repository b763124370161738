"""OpenTelemetry tracing: one SERVER span per request, with queue / prefill / decode children.

A W3C `traceparent` header on the request makes our span a child of the caller's. Spans go to an
OTLP collector only when `--otlp-endpoint` is given; the OTLP exporter package is optional and
imported only then. Tests pass their own TracerProvider with an in-memory exporter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


class TracingSetupError(RuntimeError):
    """The OTLP exporter is not installed or the endpoint is unusable."""


def otlp_tracer_provider(endpoint: str, service_name: str = "wllm") -> TracerProvider:
    """A TracerProvider exporting over OTLP/HTTP (or gRPC for `grpc://` endpoints) to `endpoint`."""
    grpc = endpoint.startswith("grpc://")
    try:
        if grpc:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[no-redef]
                OTLPSpanExporter,
            )
    except ImportError as exc:
        raise TracingSetupError(
            "--otlp-endpoint needs the OpenTelemetry OTLP exporter, which is not installed; "
            "install it with `pip install opentelemetry-exporter-otlp`"
        ) from exc
    if grpc:
        exporter = OTLPSpanExporter(endpoint=endpoint.removeprefix("grpc://"), insecure=True)
    else:
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=url)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _epoch_ns(monotonic_t: float, now_mono: float, now_ns: int) -> int:
    """Convert a time.monotonic() reading to epoch nanoseconds (what OTel timestamps use)."""
    return now_ns - int((now_mono - monotonic_t) * 1e9)


class RequestTracer:
    """Starts request spans and adds the engine-phase children once a request's times are known."""

    def __init__(self, provider: TracerProvider | trace.TracerProvider) -> None:
        from wllm.version import __version__

        self.tracer: Tracer = provider.get_tracer("wllm", __version__)

    def start_request_span(self, name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> Span:
        parent = _propagator.extract(carrier=dict(headers))
        return self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)

    def add_phases(
        self,
        parent: Span,
        arrival: float,
        scheduled: float | None,
        first_token: float | None,
        finished: float | None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        """Children `queue` (arrival->scheduled), `prefill` (->first token), `decode` (->finished)."""
        now_mono, now_ns = time.monotonic(), time.time_ns()
        ctx = trace.set_span_in_context(parent)
        scheduled = scheduled if scheduled is not None else first_token
        phases = [("queue", arrival, scheduled), ("prefill", scheduled, first_token), ("decode", first_token, finished)]
        for name, start, end in phases:
            if start is None or end is None:
                continue
            span = self.tracer.start_span(f"wllm.{name}", context=ctx, start_time=_epoch_ns(start, now_mono, now_ns))
            if attributes and name == "decode":
                span.set_attributes(attributes)
            span.end(end_time=_epoch_ns(max(end, start), now_mono, now_ns))
