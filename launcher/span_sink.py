"""An in-process OTLP/gRPC trace receiver that writes every span it gets to a JSON-lines file.

``rollmesh train`` points its child servers' standard ``OTEL_EXPORTER_OTLP_*``
variables at one of these, so the run directory holds the transition spans of
the whole mesh without an external collector (``spans.jsonl``: service, name,
kind, trace and span ids, parent, start/end in Unix nanoseconds, status code
and message, attributes, events).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(v, kind)
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return str(getattr(v, kind)) if kind else None


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Appends each exported span to ``path`` as one JSON object per line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 - gRPC method name
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        lines = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    lines.append(json.dumps({
                        "service": service, "name": span.name, "kind": span.kind,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(), "start_unix_ns": span.start_time_unix_nano,
                        "end_unix_ns": span.end_time_unix_nano, "status_code": span.status.code,
                        "status_message": span.status.message,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "events": [{"name": e.name, "unix_ns": e.time_unix_nano,
                                    "attributes": {a.key: _value(a.value) for a in e.attributes}}
                                   for e in span.events]}))
        if lines:
            with self.path.open("a") as out:
                out.write("\n".join(lines) + "\n")
            self.count += len(lines)
        return trace_service_pb2.ExportTraceServiceResponse()


async def start_span_sink(path: Path, host: str = "127.0.0.1") -> tuple[grpc.aio.Server, SpanSink, str]:
    """Serve a :class:`SpanSink` on a free port of ``host`` (loopback); returns ``(server, sink, endpoint URL)``."""
    server = grpc.aio.server()
    sink = SpanSink(path)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, sink, f"http://{host}:{port}"
