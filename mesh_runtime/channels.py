"""Client channels between rollmesh servers.

Every channel carries the tracing interceptors (W3C context in metadata) and a
service config whose ``retryPolicy`` retries only the methods the caller names
as idempotent, and only on ``UNAVAILABLE``. Application-level retries (tenacity)
must never be stacked on those methods.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
from opentelemetry.sdk.trace import TracerProvider

from . import tracing


def retry_service_config(idempotent: Sequence[tuple[str, str]], *, max_attempts: int = 4,
                         initial_backoff_s: float = 0.1, max_backoff_s: float = 2.0) -> str:
    """Service config JSON retrying ``(service, method)`` pairs on UNAVAILABLE."""
    if not idempotent:
        return json.dumps({})
    policy = {
        "maxAttempts": max_attempts,
        "initialBackoff": f"{initial_backoff_s}s",
        "maxBackoff": f"{max_backoff_s}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    names = [{"service": service, "method": method} for service, method in idempotent]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def open_channel(address: str, *, tracer_provider: TracerProvider | None,
                 idempotent: Sequence[tuple[str, str]] = (),
                 max_message_bytes: int = 64 * 1024 * 1024) -> grpc.aio.Channel:
    """An insecure ``grpc.aio`` channel to ``address`` with tracing and retries."""
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", retry_service_config(idempotent)),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]
    return grpc.aio.insecure_channel(address, options=options,
                                     interceptors=tracing.client_interceptors(tracer_provider))
