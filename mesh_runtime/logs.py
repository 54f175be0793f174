"""Log lines of every server: text for people, JSON lines for log pipelines, trace ids on both.

``--log-format json`` (or ``ROLLMESH_LOG_FORMAT=json``) writes one JSON object
per line: ``time`` (RFC 3339, UTC), ``level``, ``server``, ``logger``,
``message``, ``trace_id`` and ``span_id`` when the line is emitted inside a
span (the ids a tracing backend shows, so a log line leads to its trace), any
structured fields a call passes with ``extra=``, and ``exception`` with the
traceback. The text format appends ``trace_id=... span_id=...`` the same way.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

from opentelemetry import trace

FORMATS = ("text", "json")
FORMAT_VARIABLE = "ROLLMESH_LOG_FORMAT"

# attributes every LogRecord has: what is left over came from ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime",
                                                                                 "trace_id", "span_id"}


class TraceContextFilter(logging.Filter):
    """Sets ``trace_id`` / ``span_id`` on each record from the span current where it was emitted."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in record.__dict__.items() if key not in _STANDARD and not key.startswith("_")}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def __init__(self, server: str) -> None:
        super().__init__()
        self.server = server

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "server": self.server, "logger": record.name,
            "message": record.getMessage()}
        if getattr(record, "trace_id", ""):
            line["trace_id"], line["span_id"] = getattr(record, "trace_id"), getattr(record, "span_id")
        for key, value in _fields(record).items():
            line.setdefault(key, _plain(value))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TIME SERVER LEVEL LOGGER: MESSAGE [trace_id=... span_id=...]`` (structured fields: JSON only)."""

    def __init__(self, server: str) -> None:
        super().__init__(f"%(asctime)s {server} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not getattr(record, "trace_id", ""):
            return text
        head, newline, rest = text.partition("\n")   # keep a traceback below the line
        return f"{head} trace_id={getattr(record, 'trace_id')} span_id={getattr(record, 'span_id')}{newline}{rest}"


def configure(server: str, *, level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route the root logger to ``stream`` (stderr) in ``fmt``; replaces earlier handlers."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt[:20]!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(server) if fmt == "json" else TextFormatter(server))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
