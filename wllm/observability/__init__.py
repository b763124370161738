"""Structured logs, Prometheus metrics and OpenTelemetry tracing for the server."""
