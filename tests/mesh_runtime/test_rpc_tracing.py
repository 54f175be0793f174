"""The RPC span rules of mesh_runtime.rpc_tracing, on a real grpc.aio server and channel over loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mesh_runtime import errors, rpc_tracing
from mesh_runtime.pipeline import ServerPipeline

pytestmark = pytest.mark.timeout(60)


async def _refuse(request, context):
    raise errors.Unavailable("replica 'r0' is SLEEPING, not ACTIVE", reason="REPLICA_NOT_SERVING")


async def _missing(request, context):
    raise errors.NotFound("replica 'ghost' is not in the routing table", reason="REPLICA_NOT_FOUND")


async def _crash(request, context):
    raise RuntimeError("boom")


async def _ok(request, context):
    return request


async def _slow(request, context):
    await asyncio.sleep(30)
    return request


async def _stream(request, context):
    for i in range(100):
        yield bytes([i])
        await asyncio.sleep(0.01)


HANDLERS = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in
            {"Refuse": _refuse, "Missing": _missing, "Crash": _crash, "Ok": _ok, "Slow": _slow}.items()}
HANDLERS["Stream"] = grpc.unary_stream_rpc_method_handler(_stream)


@pytest.fixture
async def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=[ServerPipeline(tracer_provider=provider)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.v1.Probe", HANDLERS)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target, interceptors=rpc_tracing.client_interceptors(provider, target))

    def spans(method: str):
        found = {s.kind: s for s in exporter.get_finished_spans() if s.name == f"test.v1.Probe/{method}"}
        return found.get(SpanKind.SERVER), found.get(SpanKind.CLIENT)

    yield channel, spans, port
    await channel.close()
    await server.stop(0)


async def _call(channel, method: str, timeout: float = 10):
    return await channel.unary_unary(f"/test.v1.Probe/{method}")(b"x", timeout=timeout)


async def test_a_planned_refusal_is_an_event_on_both_sides_not_an_error(traced):
    channel, spans, _ = traced
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(channel, "Refuse")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    server, client = spans("Refuse")
    for span in (server, client):
        assert span.status.status_code == StatusCode.UNSET
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert span.attributes["rollmesh.error.reason"] == "REPLICA_NOT_SERVING"
        assert [(e.name, e.attributes["rollmesh.reason"]) for e in span.events] == [("rpc.refused",
                                                                                     "REPLICA_NOT_SERVING")]
    assert client.context.trace_id == server.context.trace_id and server.parent.span_id == client.context.span_id


async def test_a_callers_mistake_is_an_error_for_the_caller_only(traced):
    channel, spans, _ = traced
    with pytest.raises(grpc.aio.AioRpcError):
        await _call(channel, "Missing")
    server, client = spans("Missing")
    assert server.status.status_code == StatusCode.UNSET and server.attributes["error.type"] == "NOT_FOUND"
    assert client.status.status_code == StatusCode.ERROR and "ghost" in client.status.description


async def test_a_server_failure_is_an_error_on_both_sides(traced):
    channel, spans, _ = traced
    with pytest.raises(grpc.aio.AioRpcError):
        await _call(channel, "Crash")
    server, client = spans("Crash")
    assert server.status.status_code == client.status.status_code == StatusCode.ERROR
    assert server.attributes["error.type"] == client.attributes["error.type"] == "INTERNAL"


async def test_success_carries_the_semantic_convention_attributes(traced):
    channel, spans, port = traced
    assert await _call(channel, "Ok") == b"x"
    server, client = spans("Ok")
    assert server.status.status_code == client.status.status_code == StatusCode.UNSET
    assert client.attributes["server.address"] == "127.0.0.1" and client.attributes["server.port"] == port
    assert server.attributes["network.peer.address"] == "127.0.0.1"
    assert isinstance(server.attributes["network.peer.port"], int) and server.attributes["network.type"] == "ipv4"
    for span in (server, client):
        assert {k: span.attributes[k] for k in ("rpc.system", "rpc.service", "rpc.method", "rpc.grpc.status_code")} \
            == {"rpc.system": "grpc", "rpc.service": "test.v1.Probe", "rpc.method": "Ok", "rpc.grpc.status_code": 0}


async def test_a_call_the_caller_cancels_is_an_event_not_an_error(traced):
    channel, spans, _ = traced
    call = channel.unary_stream("/test.v1.Probe/Stream")(b"x", timeout=10)
    async for _ in call:
        break
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        async for _ in call:
            pass
    for _ in range(100):
        server, client = spans("Stream")
        if server and client:
            break
        await asyncio.sleep(0.05)
    assert client.status.status_code == StatusCode.UNSET and [e.name for e in client.events] == ["rpc.cancelled"]
    assert server.status.status_code == StatusCode.UNSET
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


async def test_a_deadline_is_an_error(traced):
    channel, spans, _ = traced
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _call(channel, "Slow", timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _, client = spans("Slow")
    assert client.status.status_code == StatusCode.ERROR and client.attributes["error.type"] == "DEADLINE_EXCEEDED"
