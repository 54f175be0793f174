"""What every call to a rollmesh server goes through before and after its servicer, in one wrapping.

:class:`ServerPipeline` is the one project interceptor of every server (a server's own, such as the
controller's standby gate, run inside it). For each call, in this order:

1. count and time it (``grpc_server_handled_total`` by code, ``grpc_server_handling_seconds``;
   :mod:`mesh_runtime.metrics`), whatever happens below;
2. decode the request from its bytes (:mod:`mesh_runtime.decoding`: malformed bytes and unknown enum
   numbers are ``INVALID_ARGUMENT``; a client stream is decoded message by message);
3. map any error raised below onto its canonical status (:mod:`mesh_runtime.errors`);
4. trace it: a SERVER span, child of the caller's, where spans are exported; elsewhere only the caller's
   trace context is made current, so it still reaches the calls the servicer makes
   (:mod:`mesh_runtime.rpc_tracing`; health and reflection are not traced);
5. on a server with mutual TLS, authorize the caller (:mod:`mesh_runtime.authorization`);
6. refuse a request whose REQUIRED fields are unset (after authorization, so a caller that may not call
   the method learns nothing about its request).

The wrapping is built once per method and reused while the handler it wraps stays the same object; the
per-call state (metadata, peer, identity) is read from the call's context. One wrapping instead of a chain
of six keeps the per-call and per-message cost of the data path low: a streamed response passes through
one generator frame here, not one per step.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from . import rpc_tracing
from .authorization import TokenCheck, authorize
from .decoding import check_required, decode
from .errors import abort_mapped
from .handlers import Rewrapped, behavior_of
from .identity import Identity, set_current_identity
from .metrics import ServerMetrics, rpc_code

_CONTEXT_KEYS = ("traceparent", "tracestate")

Context = grpc.aio.ServicerContext


def _ignore(exc: BaseException | None) -> None:
    return None


class ServerPipeline(grpc.aio.ServerInterceptor):
    """The per-call steps of every rollmesh server (see the module docstring)."""

    def __init__(self, *, metrics: ServerMetrics | None = None, tracer_provider: trace.TracerProvider | None = None,
                 authorization: bool = False,
                 token_check: TokenCheck | None = None, own: Identity | None = None) -> None:
        self._metrics = metrics
        self._tracer = trace.get_tracer(rpc_tracing.__name__, tracer_provider=tracer_provider)
        self._exports = rpc_tracing.exports(tracer_provider)
        self._authorization = authorization
        self._token_check = token_check
        self._own = own
        self._wrapped = Rewrapped()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return self._wrapped.get(method, handler, lambda inner: self._build(inner, method))

    # ------------------------------------------------------------------ steps
    def _authorize(self, method: str, context: Context) -> None:
        token_check = self._token_check
        token_ok = (lambda: token_check(context)) if token_check is not None else None
        set_current_identity(authorize(method, context.auth_context(), token_ok, self._own))

    def _tracing(self, method: str) -> Callable[[Any], contextlib.AbstractContextManager]:
        """The per-call tracing step of ``method``: a context manager yielding a callable told how the call
        ended."""
        if not rpc_tracing.traced(method):
            return lambda context: contextlib.nullcontext(_ignore)
        if not self._exports:
            @contextlib.contextmanager
            def callers_context(context: Context) -> Iterator[Callable[[BaseException | None], None]]:
                carrier = {k: v for k, v in context.invocation_metadata() or () if k in _CONTEXT_KEYS}
                if not carrier:
                    yield _ignore
                    return
                token = otel_context.attach(propagate.extract(carrier))
                try:
                    yield _ignore
                finally:
                    otel_context.detach(token)
            return callers_context
        attributes = rpc_tracing.rpc_attributes(method)
        name = f"{attributes['rpc.service']}/{attributes['rpc.method']}"
        tracer = self._tracer

        @contextlib.contextmanager
        def span_of(context: Context) -> Iterator[Callable[[BaseException | None], None]]:
            carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
            peer = None
            with contextlib.suppress(Exception):
                peer = context.peer()
            with tracer.start_as_current_span(name, context=propagate.extract(carrier), kind=SpanKind.SERVER,
                                              attributes={**attributes, **rpc_tracing.peer_attributes(peer)},
                                              record_exception=False, set_status_on_exception=False) as span:
                def ended(exc: BaseException | None) -> None:
                    code, description, reason = rpc_tracing.server_outcome(context, exc)
                    rpc_tracing.end_status(span, code, description, reason, server=True)
                yield ended
        return span_of

    def _counting(self, method: str) -> Callable[[Any, BaseException | None, float], None]:
        if self._metrics is None:
            return lambda context, failed, started: None
        service, _, name = method.lstrip("/").rpartition("/")
        handled, seconds = self._metrics.rpc_handled, self._metrics.rpc_seconds.labels(service, name)

        def counted(context: Context, failed: BaseException | None, started: float) -> None:
            handled.labels(service, name, rpc_code(context, failed)).inc()
            seconds.observe(time.perf_counter() - started)
        return counted

    # ---------------------------------------------------------------- wrapping
    def _build(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserializer = handler.request_deserializer
        client_streaming = bool(handler.stream_unary or handler.stream_stream)
        behavior = behavior_of(handler)
        traced, counted, authorizing = self._tracing(method), self._counting(method), self._authorization

        def decoded(raw: Any) -> Any:
            if client_streaming:
                return _decoded_stream(raw, deserializer, method) if deserializer is not None else raw
            return decode(deserializer, raw, method) if deserializer is not None else raw

        def checked(request: Any, context: Context) -> Any:
            if authorizing:
                self._authorize(method, context)
            return _checked_stream(request, method) if client_streaming else check_required(request, method)

        if inspect.isasyncgenfunction(behavior):
            async def wrapper(raw: Any, context: Context) -> AsyncIterator[Any]:
                started = time.perf_counter()
                failed: BaseException | None = None
                try:
                    request = decoded(raw)
                    with traced(context) as ended:
                        try:
                            async for item in behavior(checked(request, context), context):
                                yield item
                        except BaseException as exc:
                            ended(exc)
                            raise
                        ended(None)
                except grpc.aio.AbortError as exc:   # a status set by abort(): already final
                    failed = exc
                    raise
                except Exception as exc:  # noqa: BLE001 - the one mapping point
                    failed = exc
                    await abort_mapped(context, exc, method)
                except BaseException as exc:
                    failed = exc
                    raise
                finally:
                    counted(context, failed, started)
        else:
            async def wrapper(raw: Any, context: Context) -> Any:   # type: ignore[misc]
                started = time.perf_counter()
                failed: BaseException | None = None
                try:
                    request = decoded(raw)
                    with traced(context) as ended:
                        try:
                            result = await behavior(checked(request, context), context)
                        except BaseException as exc:
                            ended(exc)
                            raise
                        ended(None)
                        return result
                except grpc.aio.AbortError as exc:
                    failed = exc
                    raise
                except Exception as exc:  # noqa: BLE001
                    failed = exc
                    await abort_mapped(context, exc, method)
                except BaseException as exc:
                    failed = exc
                    raise
                finally:
                    counted(context, failed, started)

        factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                   else grpc.unary_stream_rpc_method_handler if handler.unary_stream
                   else grpc.stream_unary_rpc_method_handler if handler.stream_unary
                   else grpc.stream_stream_rpc_method_handler)
        return factory(wrapper, None, handler.response_serializer)


async def _decoded_stream(raw: AsyncIterator[bytes], deserializer: Callable[[bytes], Any],
                          method: str) -> AsyncIterator[Any]:
    async for data in raw:
        yield decode(deserializer, data, method)   # raised inside the servicer's loop: mapped by the pipeline


async def _checked_stream(messages: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for message in messages:
        yield check_required(message, method)
