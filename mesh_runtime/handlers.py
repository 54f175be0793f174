"""Rewrapping a gRPC method handler's behaviour, whatever its arity (for server interceptors)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

Wrap = Callable[[Callable], Callable]


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The servicer method a handler calls (under grpc.aio a coroutine or async-generator function)."""
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    if behavior is None:
        raise ValueError("a gRPC method handler without a behaviour")
    return behavior


def rewrap(handler: grpc.RpcMethodHandler, unary: Wrap, streaming: Wrap) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped: by ``unary`` (coroutine behaviours, including streaming
    ones that write with ``context.write()``) or by ``streaming`` (async-generator behaviours)."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), handler.request_deserializer,
                                                    handler.response_serializer)
    behavior = behavior_of(handler)
    wrapped = streaming(behavior) if inspect.isasyncgenfunction(behavior) else unary(behavior)
    factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
               else grpc.stream_stream_rpc_method_handler)
    return factory(wrapped, handler.request_deserializer, handler.response_serializer)


class Rewrapped:
    """An interceptor's wrapped handlers by method: a handler is wrapped once and the wrapping reused for
    every call while the handler it wraps is the same object (what a wrapping depends on must be the method
    and that handler alone; per-call state is read from the call's context when it runs)."""

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, method: str, inner: grpc.RpcMethodHandler,
            build: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler]) -> grpc.RpcMethodHandler:
        seen = self._by_method.get(method)
        if seen is not None and seen[0] is inner:
            return seen[1]
        wrapped = build(inner)
        self._by_method[method] = (inner, wrapped)
        return wrapped
