"""One span per RPC on both sides of every rollmesh hop, with current semantic-convention names.

The server interceptor continues the caller's W3C trace context from the call
metadata; the client interceptors inject it. Spans are named
``package.Service/Method`` and carry ``rpc.system``, ``rpc.service``,
``rpc.method``, ``rpc.grpc.status_code``, ``network.peer.address`` /
``network.peer.port`` / ``network.transport`` / ``network.type`` (the server's
view of its caller) and ``server.address`` / ``server.port`` (the client's
target). Health checks and reflection are not traced.

What counts as an error follows the OpenTelemetry RPC conventions, sharpened
for a mesh whose interruptions are planned:

- a server span is an error only for the codes that mean the server failed
  (UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE,
  DATA_LOSS); a refusal such as NOT_FOUND or PERMISSION_DENIED is the caller's
  problem and is recorded in ``rpc.grpc.status_code`` and ``error.type`` only;
- a client span is an error for any code but OK;
- on either side, a status whose ``ErrorInfo`` reason is in
  :data:`EXPECTED_REASONS` (a replica asleep, draining or taking new weights
  refuses with ``REPLICA_NOT_SERVING``; the caller goes elsewhere) is an
  ``rpc.refused`` span event with that reason, not an error, and a call this
  side cancelled itself is an ``rpc.cancelled`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .errors import canonical
from .net import AddressError, parse_host_port

Continuation = Callable[..., Any]
"""The next step of a client interceptor chain (it starts the call)."""

UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# ErrorInfo reasons of planned interruptions: span events, never error status.
EXPECTED_REASONS = frozenset({"REPLICA_NOT_SERVING"})

SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})

_DETAILS_KEY = "grpc-status-details-bin"
_MAX_DESCRIPTION = 300


def exports(provider: trace.TracerProvider | None) -> bool:
    """Whether spans made with ``provider`` go anywhere: False for a provider
    :func:`mesh_runtime.tracing.create_tracer_provider` made without an exporter (its spans are not made
    at all, so the data path pays nothing for tracing that is off); True for any other provider."""
    return provider is None or getattr(provider, "rollmesh_exports", True)


def traced(method: str) -> bool:
    return not method.startswith(UNTRACED_PREFIXES)


def rpc_attributes(method: str) -> dict[str, str]:
    """``rpc.*`` attributes of ``/package.Service/Method``."""
    service, _, name = method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def peer_attributes(peer: str | None) -> dict[str, str | int]:
    """``network.*`` attributes of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:/p``)."""
    if not peer:
        return {}
    family, _, rest = peer.partition(":")
    if family == "unix":
        return {"network.transport": "unix", "network.peer.address": rest}
    if family not in ("ipv4", "ipv6"):
        return {}
    try:
        host, port = parse_host_port(rest)
    except AddressError:
        return {}
    return {"network.transport": "tcp", "network.type": family, "network.peer.address": host,
            "network.peer.port": port}


def target_attributes(target: str | None) -> dict[str, str | int]:
    """``server.address`` / ``server.port`` of a channel target ``HOST:PORT``."""
    if not target:
        return {}
    try:
        host, port = parse_host_port(target)
    except AddressError:
        return {"server.address": target}
    return {"server.address": host, "server.port": port}


def reason_in(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The ``ErrorInfo`` reason carried in a call's trailing metadata ('' without one)."""
    for key, value in trailing_metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                status = status_pb2.Status.FromString(value)
            except Exception:  # noqa: BLE001 - a malformed detail is no reason
                return ""
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return ""


def end_status(span: trace.Span, code: grpc.StatusCode, description: str, reason: str, *, server: bool,
               cancelled_here: bool = False) -> None:
    """Record how an RPC ended on ``span`` (the rules in the module docstring)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code == grpc.StatusCode.OK:
        return
    span.set_attribute("error.type", code.name)
    if reason:
        span.set_attribute("rollmesh.error.reason", reason)
    if cancelled_here:
        span.add_event("rpc.cancelled", {"rollmesh.reason": description[:_MAX_DESCRIPTION] or "cancelled"})
        return
    if reason in EXPECTED_REASONS:
        span.add_event("rpc.refused", {"rollmesh.reason": reason,
                                       "rollmesh.message": description[:_MAX_DESCRIPTION]})
        return
    if server and code not in SERVER_ERROR_CODES:
        return
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {description[:_MAX_DESCRIPTION]}"))


def server_outcome(context: grpc.aio.ServicerContext, exc: BaseException | None) -> tuple[grpc.StatusCode, str, str]:
    """(code, description, reason) of a handler that returned or raised ``exc``."""
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        code = None
        try:
            code = context.code()
        except Exception:  # noqa: BLE001
            pass
        if isinstance(code, grpc.StatusCode):
            details = ""
            try:
                details = context.details() or ""
            except Exception:  # noqa: BLE001
                pass
            return code, details if isinstance(details, str) else "", ""
        return (grpc.StatusCode.OK, "", "") if exc is None else (grpc.StatusCode.UNKNOWN, "aborted", "")
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):   # the caller went away mid-call
        return grpc.StatusCode.CANCELLED, "the caller cancelled", ""
    mapped = canonical(exc)
    if mapped is not None:
        return grpc.StatusCode[mapped.code], mapped.message, mapped.reason or ""
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", ""


class _ClientTracing:
    """What the four client interceptors share: span start, context injection, end."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, target: str | None = None) -> None:
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        self._target = target_attributes(target)
        self._exports = exports(tracer_provider)

    def _start(self, details: grpc.aio.ClientCallDetails) -> tuple[trace.Span | None, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if not traced(method):
            return None, details
        if not self._exports:   # no span: the current context (a caller's) still travels
            extra = context_metadata()
            if not extra:
                return None, details
            metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), *extra)
            return None, grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                                    details.wait_for_ready)
        attributes = rpc_attributes(method)
        span = self._tracer.start_span(f"{attributes['rpc.service']}/{attributes['rpc.method']}",
                                       kind=SpanKind.CLIENT, attributes={**attributes, **self._target})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        for key, value in carrier.items():
            metadata.add(key, value)
        # the method goes on as it came (grpc.aio hands it over as bytes and wants bytes back)
        return span, grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                                details.wait_for_ready)

    @staticmethod
    def _failed(span: trace.Span, err: BaseException) -> None:
        if isinstance(err, grpc.aio.AioRpcError):
            cancelled = err.code() == grpc.StatusCode.CANCELLED and "locally" in (err.details() or "").lower()
            end_status(span, err.code(), err.details() or "", reason_in(err.trailing_metadata()),
                       server=False, cancelled_here=cancelled)
        elif isinstance(err, (asyncio.CancelledError, GeneratorExit)):
            end_status(span, grpc.StatusCode.CANCELLED, "cancelled by this caller", "", server=False,
                       cancelled_here=True)
        else:
            end_status(span, grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}", "", server=False)

    async def _unary(self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        span, details = self._start(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
            code = await call.code()
            if code == grpc.StatusCode.OK:
                end_status(span, code, "", "", server=False)
            else:
                cancelled = code == grpc.StatusCode.CANCELLED
                end_status(span, code, await call.details() or "", reason_in(await call.trailing_metadata()),
                           server=False, cancelled_here=cancelled)
            return call
        except BaseException as err:
            self._failed(span, err)
            raise
        finally:
            span.end()

    async def _streaming(self, continuation: Continuation, details: grpc.aio.ClientCallDetails,
                         request: Any) -> Any:
        span, details = self._start(details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
        except BaseException as err:
            self._failed(span, err)
            span.end()
            raise
        return self._responses(span, call)

    async def _responses(self, span: trace.Span, call: AsyncIterable[Any]) -> AsyncIterator[Any]:
        try:
            async for response in call:
                yield response
        except BaseException as err:
            self._failed(span, err)
            raise
        else:
            end_status(span, grpc.StatusCode.OK, "", "", server=False)
        finally:
            span.end()


class UnaryUnaryTracing(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Continuation, client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await self._unary(continuation, client_call_details, request)


class StreamUnaryTracing(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Continuation,
                                     client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await self._unary(continuation, client_call_details, request_iterator)


class UnaryStreamTracing(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Continuation,
                                     client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await self._streaming(continuation, client_call_details, request)


class StreamStreamTracing(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Continuation,
                                      client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await self._streaming(continuation, client_call_details, request_iterator)


def context_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as call metadata (W3C ``traceparent``), for a call on an untraced channel:
    the callee follows this process's sampling decision."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def client_interceptors(tracer_provider: trace.TracerProvider | None = None,
                        target: str | None = None) -> list[grpc.aio.ClientInterceptor]:
    """The four client interceptors of one channel to ``target``."""
    return [cls(tracer_provider, target) for cls in
            (UnaryUnaryTracing, UnaryStreamTracing, StreamUnaryTracing, StreamStreamTracing)]

