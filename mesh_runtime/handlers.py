"""Rewrapping a gRPC method handler's behaviour, whatever its arity (for server interceptors)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

Wrap = Callable[[Callable], Callable]


def rewrap(handler: grpc.RpcMethodHandler, unary: Wrap, streaming: Wrap) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped: by ``unary`` (coroutine behaviours, including streaming
    ones that write with ``context.write()``) or by ``streaming`` (async-generator behaviours)."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), handler.request_deserializer,
                                                    handler.response_serializer)
    behavior = handler.unary_stream or handler.stream_stream
    wrapped = streaming(behavior) if inspect.isasyncgenfunction(behavior) else unary(behavior)
    factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
               else grpc.stream_stream_rpc_method_handler)
    return factory(wrapped, handler.request_deserializer, handler.response_serializer)
