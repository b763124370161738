"""Logging setup: one JSON object per line (for log shippers) or plain text (for people).

Structured fields travel in a record's `fields` attribute (`logger.info("...", extra={"fields":
{...}})`); the JSON formatter merges them into the top-level object, the text formatter appends
them as key=value pairs. API keys never reach a log record; requests carry only a key id.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

LogFormat = Literal["json", "text"]

_encoder = msgspec.json.Encoder()


class JSONFormatter(logging.Formatter):
    """Formats a record as one compact JSON line: ts, level, logger, msg, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        obj: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            obj.update(fields)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(obj).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def setup_logging(fmt: LogFormat = "text", level: str | int = "INFO",
                  extra_handlers: Sequence[logging.Handler] = ()) -> None:
    """Route wllm and uvicorn loggers to stderr in the chosen format (idempotent), and to
    `extra_handlers` too (the Windows service's Event Log)."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    for name in ("wllm", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler, *extra_handlers]
        logger.setLevel(level)
        logger.propagate = False
    # Our access log (wllm.access) replaces uvicorn's, which knows neither tokens nor key ids.
    logging.getLogger("uvicorn.access").handlers[:] = []
    logging.getLogger("uvicorn.access").propagate = False
