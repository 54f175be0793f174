"""Several load balancers behind one channel: a consistent-hash ring over their addresses.

:func:`open_balancer_channel` is what a generation client opens: one balancer's channel, or a
:class:`HashRingChannel` over ``HOST:PORT,HOST:PORT,...`` that keeps one request id (and one session) on one
balancer while it lives.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider

from .channels import (Deserializer, ObservedStreamCall, OpenOne, PerAddress, Serializer, address_list, as_channel,
                       open_channel)
from .config import TlsConfig


def ring_key(request: Any) -> str:
    """What places a request on the balancers' ring: its session, else its request id (empty: none)."""
    return getattr(request, "session_id", "") or getattr(request, "request_id", "") or ""


class HashRingChannel(PerAddress):
    """A channel over several load balancers that sends each request to one chosen by its :func:`ring_key`
    (its ``session_id``, else its ``request_id``).

    Every balancer address has ``points`` places on a hash ring; a request goes to the first live balancer
    clockwise of the hash of its key, so one id always lands on the same balancer (whose exactly-once
    bookkeeping per id then holds: a request id keeps its session), the requests of one session (a GRPO
    group, a trajectory's turns, its CloseSession) meet on one balancer and so on its sticky replica, and
    keys spread evenly. A balancer that cannot be reached is
    skipped for ``down_s`` seconds: a unary call is resent at once to the next balancer in the ring (same
    request, same id); a stream's failure is its caller's (the rollouter retries a Generate with the same
    id), and that retry lands on the next balancer. A request without a ``request_id`` goes to the balancers
    in turn. Looks like a ``grpc.aio.Channel`` to generated stubs.
    """

    def __init__(self, addresses: Sequence[str], open_one: OpenOne, *, points: int = 64,
                 down_s: float = 5.0) -> None:
        import hashlib  # noqa: PLC0415
        import itertools  # noqa: PLC0415

        super().__init__(addresses, open_one)
        self.down_s = down_s
        self._points = points
        self._down: dict[str, float] = {}
        self._hash = lambda key: int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
        self.set_addresses(self.addresses)
        self._turn = itertools.count()

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Change the set of balancers (a client that reads it from the controller). Each id keeps its
        balancer unless that one left, or a new one took its arc of the ring: about 1/N of the ids move."""
        if not addresses:
            raise ValueError("a balancer ring needs at least one address")
        self.addresses = list(dict.fromkeys(addresses))
        self._ring = sorted((self._hash(f"{address}#{i}"), address) for address in self.addresses
                            for i in range(self._points))

    def order(self, request_id: str) -> list[str]:
        """Every balancer, in the order a request with this id tries them (live ones first)."""
        import bisect  # noqa: PLC0415

        if request_id:
            start = bisect.bisect(self._ring, (self._hash(request_id), ""))
            walk = [self._ring[(start + i) % len(self._ring)][1] for i in range(len(self._ring))]
            ordered = list(dict.fromkeys(walk))
        else:
            first = next(self._turn) % len(self.addresses)
            ordered = self.addresses[first:] + self.addresses[:first]
        now = time.monotonic()
        return [a for a in ordered if self._down.get(a, 0.0) <= now] + \
               [a for a in ordered if self._down.get(a, 0.0) > now]

    def channel(self, address: str) -> grpc.aio.Channel:
        return self._channel(address)

    def observe(self, err: grpc.RpcError, address: str) -> bool:
        """Mark ``address`` down after a transport failure; True when the call can go to the next balancer."""
        from .errors import error_info  # noqa: PLC0415

        if err.code() != grpc.StatusCode.UNAVAILABLE or error_info(err) is not None:
            return False   # the balancer answered (e.g. no eligible replica): not a dead balancer
        self._down[address] = time.monotonic() + self.down_s
        return True

    def unary_unary(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        ring = self

        async def call(request: Any, **kwargs: Any) -> Any:
            order = ring.order(ring_key(request))
            for index, address in enumerate(order):
                try:
                    return await ring.channel(address).unary_unary(
                        method, request_serializer=request_serializer,
                        response_deserializer=response_deserializer)(request, **kwargs)
                except grpc.aio.AioRpcError as err:
                    if not ring.observe(err, address) or index == len(order) - 1:
                        raise
        return call

    def unary_stream(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        ring = self

        def call(request: Any, **kwargs: Any) -> ObservedStreamCall:
            address = ring.order(ring_key(request))[0]
            inner = ring.channel(address).unary_stream(method, request_serializer=request_serializer,
                                                       response_deserializer=response_deserializer)(request, **kwargs)
            return ObservedStreamCall(inner, ring, address)
        return call

    def stream_stream(self, method: str, request_serializer: Serializer = None,
                      response_deserializer: Deserializer = None, **_: Any) -> Any:
        """A stream carries no request id to hash: it goes to the next live balancer in turn (a caller that
        wants one per balancer opens it on :meth:`channel`, as :mod:`mesh_runtime.generate_many` does)."""
        ring = self

        def call(request_iterator: Any = None, **kwargs: Any) -> Any:
            address = ring.order("")[0]
            return ring.channel(address).stream_stream(method, request_serializer=request_serializer,
                                                       response_deserializer=response_deserializer)(
                request_iterator, **kwargs)
        return call


def open_balancer_channel(address: str, *, tls: TlsConfig | None = None,
                          tracer_provider: TracerProvider | None = None,
                          idempotent: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel:
    """The channel of a generation client to its balancers: :func:`open_channel` for one address, a
    :class:`HashRingChannel` (requests spread by ``request_id``) for ``HOST:PORT,HOST:PORT,...``."""
    addresses = address_list(address)
    if len(addresses) > 1:
        return as_channel(HashRingChannel(addresses, functools.partial(
            open_channel, tls=tls, tracer_provider=tracer_provider, idempotent=idempotent)))
    return open_channel(address, tls=tls, tracer_provider=tracer_provider, idempotent=idempotent)
