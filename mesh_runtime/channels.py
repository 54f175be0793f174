"""Client channels between rollmesh servers, and from the launcher and the CLI: the one channel factory.

Every channel carries the same options (message size, keepalive) and a
service config whose ``retryPolicy`` retries only the methods the caller names
as idempotent, and only on ``UNAVAILABLE``. :data:`READ_METHODS` is that set
for reads: every unary ``Get*`` / ``List*`` method of rollmesh's four
services, read once from the generated descriptors. Application-level
retries (tenacity) must never be stacked on the methods a channel retries.
:func:`open_channel` (``grpc.aio``) also carries the tracing interceptors (W3C
context in metadata); :func:`open_sync_channel` is the blocking variant for
tools that have no event loop (``rollmesh top``). Given a ``tls`` config,
both present its certificate and verify the server's against its CA
(mutual TLS, :mod:`mesh_runtime.tls`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Sequence

import grpc
from opentelemetry.sdk.trace import TracerProvider

from . import tracing
from .config import TlsConfig
from .tls import channel_credentials, tls_stamp

_SERVICE_MODULES = ("rollmesh.controller.v1.controller_pb2", "rollmesh.loadbalancer.v1.loadbalancer_pb2",
                    "rollmesh.replica.v1.replica_agent_pb2", "rollmesh.trainer.v1.trainer_agent_pb2",
                    "google.longrunning.operations_pb2")


@functools.cache
def read_methods() -> tuple[tuple[str, str], ...]:
    """``(service full name, method)`` of every unary Get*/List* RPC: reads, safe to retry on UNAVAILABLE."""
    import importlib  # noqa: PLC0415

    found = []
    for module_name in _SERVICE_MODULES:
        module = importlib.import_module(module_name)
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                unary = not method.client_streaming and not method.server_streaming
                if unary and method.name.startswith(("Get", "List")):
                    found.append((service.full_name, method.name))
    return tuple(sorted(found))


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


def channel_options(idempotent: Sequence[tuple[str, str]] = (),
                    max_message_bytes: int = 64 * 1024 * 1024) -> list[tuple[str, object]]:
    """The options every rollmesh channel is opened with."""
    return [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", retry_service_config(idempotent)),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def open_channel(address: str, *, tls: TlsConfig | None = None, tracer_provider: TracerProvider | None = None,
                 idempotent: Sequence[tuple[str, str]] = (),
                 max_message_bytes: int = 64 * 1024 * 1024) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` with tracing and retries of ``idempotent`` methods: mutual
    TLS presenting ``tls.cert`` when ``tls`` is given, plaintext otherwise."""
    options = channel_options(idempotent, max_message_bytes)
    interceptors = tracing.client_interceptors(tracer_provider, address)
    if tls is not None:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def open_sync_channel(address: str, *, tls: TlsConfig | None = None, idempotent: Sequence[tuple[str, str]] = (),
                      max_message_bytes: int = 64 * 1024 * 1024) -> grpc.Channel:
    """The blocking variant of :func:`open_channel` (no tracing: tools without an event loop)."""
    options = channel_options(idempotent, max_message_bytes)
    if tls is not None:
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)


class ChannelPool:
    """One channel per peer address, for a server's outgoing calls; closed with :meth:`close`.

    With ``tls``, the certificate files are checked (at most once a second)
    and a channel opened before they changed is replaced on its next use, so
    a rotated certificate reaches every peer without a restart. The replaced
    channel is closed once its calls had ``retire_grace_s`` to finish.
    """

    def __init__(self, *, tls: TlsConfig | None = None, tracer_provider: TracerProvider | None = None,
                 idempotent: Sequence[tuple[str, str]] = (), retire_grace_s: float = 600.0) -> None:
        self._tls = tls
        self._tracer_provider = tracer_provider
        self._idempotent = tuple(idempotent)
        self._retire_grace_s = retire_grace_s
        self._channels: dict[str, tuple[grpc.aio.Channel, tuple]] = {}
        self._retiring: set[asyncio.Task] = set()
        self._stamp: tuple = tls_stamp(tls)
        self._checked = time.monotonic()

    def get(self, address: str) -> grpc.aio.Channel:
        self._refresh_stamp()
        entry = self._channels.get(address)
        if entry is not None and entry[1] == self._stamp:
            return entry[0]
        if entry is not None:
            self._retire(entry[0])
        channel = open_channel(address, tls=self._tls, tracer_provider=self._tracer_provider,
                               idempotent=self._idempotent)
        self._channels[address] = (channel, self._stamp)
        return channel

    def _refresh_stamp(self) -> None:
        if self._tls is None or time.monotonic() - self._checked < 1.0:
            return
        self._checked = time.monotonic()
        stamp = tls_stamp(self._tls)
        if None not in stamp:   # a file missing mid-rotation: keep the channels until it is back
            self._stamp = stamp

    def _retire(self, channel: grpc.aio.Channel) -> None:
        async def close_later() -> None:
            await asyncio.sleep(self._retire_grace_s)
            await channel.close()
        try:
            task = asyncio.get_running_loop().create_task(close_later())
        except RuntimeError:   # no loop running (tests that build a pool outside one): nothing is in flight
            return
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
