"""Client channels between rollmesh servers, and from the launcher and the CLI: the one channel factory.

Every channel carries the same options (message size, keepalive) and a
service config whose ``retryPolicy`` retries only the methods the caller names
as idempotent, and only on ``UNAVAILABLE``. :data:`READ_METHODS` is that set
for reads: every unary ``Get*`` / ``List*`` method of rollmesh's four
services, read once from the generated descriptors. Application-level
retries (:func:`mesh_runtime.retry.call_again` and the servers' own loops)
must never be stacked on the methods a channel retries.
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
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, Self

import grpc
from opentelemetry.sdk.trace import TracerProvider

from . import tracing
from .config import TlsConfig
from .retry import RetryPolicy
from .tls import channel_credentials, tls_stamp

OpenOne = Callable[[str], grpc.aio.Channel]
"""Opens the channel to one address of a multi-address channel."""
Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None

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
                 max_message_bytes: int = 64 * 1024 * 1024, traced: bool = True) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` with tracing and retries of ``idempotent`` methods: mutual
    TLS presenting ``tls.cert`` when ``tls`` is given, plaintext otherwise. A list ``HOST:PORT,HOST:PORT``
    (several controllers) is a :class:`FollowingChannel` over one such channel per address. ``traced``
    False: no client interceptor (no span, no task per call); the caller propagates trace context itself
    (:func:`mesh_runtime.rpc_tracing.context_metadata`)."""
    addresses = address_list(address)
    if len(addresses) > 1:
        return as_channel(FollowingChannel(addresses, functools.partial(
            open_channel, tls=tls, tracer_provider=tracer_provider, idempotent=idempotent,
            max_message_bytes=max_message_bytes, traced=traced)))
    options = channel_options(idempotent, max_message_bytes)
    interceptors = tracing.client_interceptors(tracer_provider, address) if traced else []
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

    def get(self, address: str, *, traced: bool = True) -> grpc.aio.Channel:
        """The channel to ``address``; ``traced`` False: its twin without client interceptors (see
        :func:`open_channel`), for a data path whose calls are not being traced."""
        self._refresh_stamp()
        key = address if traced else f"untraced:{address}"
        entry = self._channels.get(key)
        if entry is not None and entry[1] == self._stamp:
            return entry[0]
        if entry is not None:
            self._retire(entry[0])
        channel = open_channel(address, tls=self._tls, tracer_provider=self._tracer_provider,
                               idempotent=self._idempotent, traced=traced)
        self._channels[key] = (channel, self._stamp)
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


# ------------------------------------------------------------------ following the leading controller
def address_list(address: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` as a list (spaces ignored, order kept, duplicates dropped)."""
    return list(dict.fromkeys(a.strip() for a in address.split(",") if a.strip()))


_NEVER_SENT = ("failed to connect", "connection refused", "dns resolution failed", "name resolution")
"""Words of the UNAVAILABLE details of a call that never reached a server: safe to send elsewhere."""


@functools.cache
def effect_free_methods() -> frozenset[str]:
    """Paths (``/service/method``) of the unary calls that change nothing: the reads, and
    ``google.longrunning.Operations/WaitOperation`` (a long poll). Resending one is always safe."""
    reads = {f"/{service}/{method}" for service, method in read_methods()}
    return frozenset(reads | {"/google.longrunning.Operations/WaitOperation"})


def as_channel(channel: PerAddress) -> grpc.aio.Channel:
    """A channel over several addresses, typed as the ``grpc.aio.Channel`` the generated stubs take: it serves
    the methods they call (the multi-callables, ``channel_ready``, ``close``, ``async with``)."""
    return typing.cast(grpc.aio.Channel, channel)


class PerAddress:
    """One channel per address, opened on first use by ``open_one``; closed together."""

    def __init__(self, addresses: Sequence[str], open_one: OpenOne) -> None:
        if not addresses:
            raise ValueError(f"{type(self).__name__} needs at least one address")
        self.addresses = list(addresses)
        self._open_one = open_one
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self._open_one(address)
        return self._channels[address]

    async def close(self, grace: float | None = None) -> None:
        for channel in self._channels.values():
            await channel.close(grace)
        self._channels.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class FollowingChannel(PerAddress):
    """A channel over several controllers' addresses that sends every call to the leading one.

    It looks like a ``grpc.aio.Channel`` to generated stubs. A standby answers
    anything but reads with ``UNAVAILABLE`` / ``NOT_LEADER`` naming the leader
    (``ErrorInfo`` metadata ``leader``): the call is sent there at once (the
    standby did nothing, so this is safe for every method). A call that could
    not reach its address at all is sent to the next one in the list. Both
    repeat, with a short growing pause, until the call's ``timeout`` (or
    ``failover_s`` when it has none) is spent, so a caller rides through a
    failover without seeing it. Any other failure (including a connection
    lost after the call was sent, whose effect is unknown) is the caller's, as
    on a plain channel, but the next call goes to the next address; a call
    that changes nothing (:func:`effect_free_methods`) is resent after any
    ``UNAVAILABLE``, as a call that never arrived is. Streams
    are not resent (their caller resumes them, e.g. ``WatchEvents`` from its
    last sequence); their failures move the channel the same way.
    """

    def __init__(self, addresses: Sequence[str], open_one: OpenOne, *, failover_s: float = 30.0) -> None:
        super().__init__(addresses, open_one)
        self.current = self.addresses[0]
        self.failover_s = failover_s

    def channel(self, address: str | None = None) -> grpc.aio.Channel:
        return self._channel(address or self.current)

    def observe(self, err: grpc.RpcError, address: str) -> bool:
        """Move after ``err`` from ``address``; True when the call surely did nothing (resend it)."""
        from .errors import error_info  # noqa: PLC0415 - errors imports grpc_status, kept off import time

        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        info = error_info(err)
        if info is not None and info.reason == "NOT_LEADER":
            leader = info.metadata.get("leader", "")
            if leader and leader != address:
                if leader not in self.addresses:
                    self.addresses.append(leader)
                self.current = leader
            else:
                self._rotate(address)
            return True
        if info is None:
            self._rotate(address)
            return any(word in (err.details() or "").lower() for word in _NEVER_SENT)
        return False

    def _rotate(self, address: str) -> None:
        if self.current == address and len(self.addresses) > 1:
            index = self.addresses.index(address) if address in self.addresses else -1
            self.current = self.addresses[(index + 1) % len(self.addresses)]

    def unary_unary(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        return _FollowingUnary(self, method, request_serializer, response_deserializer,
                               effect_free=method in effect_free_methods())

    def unary_stream(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        return _FollowingStream(self, "unary_stream", method, request_serializer, response_deserializer)

    def stream_stream(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        return _FollowingStream(self, "stream_stream", method, request_serializer, response_deserializer)

    def stream_unary(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        return self.channel().stream_unary(method, request_serializer=request_serializer,
                                           response_deserializer=response_deserializer)

    async def channel_ready(self) -> None:
        await self.channel().channel_ready()


class _FollowingUnary:
    def __init__(self, owner: FollowingChannel, method: str, serializer: Serializer,
                 deserializer: Deserializer, *, effect_free: bool) -> None:
        self._owner, self._method, self._effect_free = owner, method, effect_free
        self._serializer, self._deserializer = serializer, deserializer

    def __call__(self, request: Any, *, timeout: float | None = None, **kwargs: Any) -> Awaitable[Any]:
        return self._call(request, timeout, kwargs)

    async def _call(self, request: Any, timeout: float | None, kwargs: dict[str, Any]) -> Any:
        owner = self._owner
        within = timeout if timeout is not None else owner.failover_s
        deadline = time.monotonic() + within
        tried = owner.current

        async def attempt() -> Any:
            nonlocal tried
            tried = owner.current
            callable_ = owner.channel(tried).unary_unary(self._method, request_serializer=self._serializer,
                                                         response_deserializer=self._deserializer)
            left = deadline - time.monotonic()
            return await callable_(request, timeout=left if timeout is not None else None, **kwargs)

        def resend(err: BaseException) -> bool:
            if not isinstance(err, grpc.aio.AioRpcError):
                return False
            moved = owner.observe(err, tried)
            return moved or (self._effect_free and err.code() == grpc.StatusCode.UNAVAILABLE)

        def elsewhere(err: BaseException) -> float | None:
            """A new address to go to: at once; the same one again: after the backoff."""
            return 0.0 if owner.current != tried and len(owner.addresses) > 1 else None

        policy = RetryPolicy(initial_s=0.05, max_s=1.0, within_s=within)
        return await policy.run(attempt, retry_if=resend, wait_hint=elsewhere)


class _FollowingStream:
    """A streaming call on the current address; its failure moves the channel (the caller resumes)."""

    def __init__(self, owner: FollowingChannel, kind: str, method: str, serializer: Serializer,
                 deserializer: Deserializer) -> None:
        self._owner, self._kind, self._method = owner, kind, method
        self._serializer, self._deserializer = serializer, deserializer

    def __call__(self, request: Any, **kwargs: Any) -> ObservedStreamCall:
        address = self._owner.current
        factory = getattr(self._owner.channel(address), self._kind)
        call = factory(self._method, request_serializer=self._serializer,
                       response_deserializer=self._deserializer)(request, **kwargs)
        return ObservedStreamCall(call, self._owner, address)


class StreamObserver(Protocol):
    """What learns of a streaming call's failure (the channel over several addresses that placed it)."""

    def observe(self, err: grpc.aio.AioRpcError, address: str) -> bool: ...


class ObservedStreamCall:
    """A streaming call whose failure its channel hears of (to move on, or to mark the address down)."""

    def __init__(self, call: Any, owner: StreamObserver, address: str) -> None:
        self._call, self._owner, self._address = call, owner, address

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        try:
            async for message in self._call:
                yield message
        except grpc.aio.AioRpcError as err:
            self._owner.observe(err, self._address)
            raise

    async def read(self) -> Any:
        try:
            return await self._call.read()
        except grpc.aio.AioRpcError as err:
            self._owner.observe(err, self._address)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)
