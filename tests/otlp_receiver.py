"""A real OTLP/gRPC trace receiver for tests: collects exported spans in memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    start_ns: int = 0
    end_ns: int = 0
    status: int = 0
    """OTLP status code: 0 unset, 1 ok, 2 error."""


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Stores every span of every Export call; lets tests wait for a condition."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = asyncio.Condition()

    async def Export(self, request, context):  # noqa: N802 - gRPC method name
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attrs = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                    self.spans.append(ReceivedSpan(service, span.name, span.kind, span.trace_id.hex(),
                                                   span.span_id.hex(), span.parent_span_id.hex(), attrs,
                                                   span.start_time_unix_nano, span.end_time_unix_nano,
                                                   span.status.code))
        async with self._changed:
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(self, predicate, timeout_s: float = 30.0) -> None:
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self.spans))
        await asyncio.wait_for(wait(), timeout_s)


async def start_receiver() -> tuple[grpc.aio.Server, Receiver, int]:
    server = grpc.aio.server()
    receiver = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, receiver, port
