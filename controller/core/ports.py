"""Ports: the async interfaces through which the core acts on other servers.

The gRPC layer implements them with real clients and the simulator with
simulated ones; the core only awaits them, each call bounded by a timeout
from :class:`~controller.core.config.SchedulingConfig`.

Replica calls take a list of ids and report per-replica failures in a
:class:`ReplicaCallResult`; the controller issues one call per node,
concurrently, so a hung or failing agent affects only its own replicas.
``None`` as a result means "all succeeded". Any exception (including
``TimeoutError``) fails every replica of that call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2


Clock = Callable[[], float]
"""Seconds on the controller's clock (wall or virtual)."""


@dataclasses.dataclass(frozen=True)
class ReplicaCallResult:
    """Outcome of one replica-port call."""

    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Replica id -> why, for the replicas the call did not succeed on."""
    aborted_requests: int = 0
    """For ``abort``: in-flight requests aborted."""


@dataclasses.dataclass(frozen=True)
class ReplicaSyncOutcome:
    """One replica's part in a weight broadcast (``ReplicaSyncResult``)."""

    replica_id: str
    ok: bool
    error_message: str = ""
    duration_s: float = 0.0
    bytes_received: int = 0
    copy: str = ""
    """How it got the version: ``delta`` (from the version it held), ``full`` (a full copy from the trainer)
    or ``peer`` (a full copy from a replica that held the version); empty when not recorded."""
    source: str = ""
    """Who sent it: the trainer's member id or a peer replica's id."""
    delta_base_missing: bool = False
    """It was in a delta plan without holding the base version: it needs a full copy."""


@dataclasses.dataclass(frozen=True)
class WeightSyncOutcome:
    """Summary of one weight broadcast (``WeightSyncResult``)."""

    weight_version: int
    replica_results: tuple[ReplicaSyncOutcome, ...] = ()
    bytes_sent: int = 0
    duration_s: float = 0.0
    sync_id: str = ""
    source: str = "trainer"
    skipped_replica_ids: tuple[str, ...] = ()
    bytes_saved: int = 0
    delta_base_version: int = -1
    """The version the delta went out from; -1: no delta."""
    delta_bytes: int = 0
    """Bytes of the delta stream (each receiver of the delta got this many)."""
    full_bytes: int = 0
    """Bytes of a full copy of the version."""
    delta_density: float = 0.0
    """Share of the version's words that changed since the delta's base."""

    @property
    def failed(self) -> dict[str, str]:
        return {r.replica_id: r.error_message or "weight sync failed"
                for r in self.replica_results if not r.ok}

    @property
    def full_copies(self) -> dict[str, str]:
        """Replicas that took a full copy (from the trainer or a peer) -> who sent it."""
        return {r.replica_id: r.source for r in self.replica_results if r.ok and r.copy in ("full", "peer")}

    def attributes(self) -> dict[str, object]:
        """What an event about this sync records of its bytes and copies."""
        return {"bytes_sent": self.bytes_sent, "delta_base_version": self.delta_base_version,
                "delta_bytes": self.delta_bytes, "full_bytes": self.full_bytes,
                "delta_density": round(self.delta_density, 6),
                "delta_copies": sum(1 for r in self.replica_results if r.ok and r.copy == "delta"),
                "full_copies": len(self.full_copies),
                "peer_copies": sum(1 for r in self.replica_results if r.ok and r.copy == "peer")}

    def to_document(self) -> state_pb2.WeightSync:
        return state_pb2.WeightSync(
            weight_version=self.weight_version, bytes_sent=self.bytes_sent, duration_s=self.duration_s,
            sync_id=self.sync_id, source=self.source, skipped_replica_ids=self.skipped_replica_ids,
            bytes_saved=self.bytes_saved,
            replica_results=[state_pb2.ReplicaSync(replica_id=r.replica_id, ok=r.ok, error_message=r.error_message,
                                                   duration_s=r.duration_s, bytes_received=r.bytes_received)
                             for r in self.replica_results])

    @classmethod
    def from_document(cls, doc: state_pb2.WeightSync) -> WeightSyncOutcome:
        return cls(
            weight_version=doc.weight_version, bytes_sent=doc.bytes_sent, duration_s=doc.duration_s,
            sync_id=doc.sync_id, source=doc.source, skipped_replica_ids=tuple(doc.skipped_replica_ids),
            bytes_saved=doc.bytes_saved,
            replica_results=tuple(ReplicaSyncOutcome(r.replica_id, r.ok, r.error_message, r.duration_s,
                                                     r.bytes_received) for r in doc.replica_results))


class RoutingPort(Protocol):
    """Who the load balancers route: transitions say which replicas leave or enter service, the routing
    reconciler (:mod:`controller.routing`; the simulator's balancer) writes the tables."""

    async def take_out(self, replica_ids: Sequence[str], *, why: str = "taken out of service",
                       abort_in_flight: bool = False) -> None:
        """Take replicas out of service: out of routing before this returns, and kept out until a transition
        brings them back. ``abort_in_flight`` also ends their open requests there, which then resume elsewhere
        (a replica that lost its lease may be frozen and never finish them). Raises when no balancer took it
        (nothing changed)."""
        ...
    async def bring_in(self, replica_ids: Sequence[str]) -> None:
        """Put replicas into service now, ahead of their becoming ACTIVE (a woken hybrid replica is routed
        before it resumes). Raises when no balancer took it (nothing changed)."""
        ...
    async def rebalance(self) -> int | None:
        """Move in-flight requests toward less loaded replicas; the number moved (None: unknown)."""
        ...
    async def clear_sticky(self) -> None: ...


class ReplicaPort(Protocol):
    """Replica agents' engine controls."""

    async def abort(self, replica_ids: Sequence[str]) -> ReplicaCallResult | None: ...
    async def sleep(self, replica_ids: Sequence[str], level: int) -> ReplicaCallResult | None: ...
    async def wake(self, replica_ids: Sequence[str]) -> ReplicaCallResult | None: ...
    async def resume(self, replica_ids: Sequence[str]) -> ReplicaCallResult | None: ...
    async def stop(self, replica_ids: Sequence[str]) -> ReplicaCallResult | None:
        """Stop engines outright; used on replicas that failed to sleep, to free their memory."""
        ...


class WeightSyncPort(Protocol):
    """The trainer-to-replica weight broadcast."""

    async def sync(self, replica_ids: Sequence[str], version: int) -> WeightSyncOutcome: ...

    def model_bytes(self) -> int:
        """Bytes of one full copy of the weights (0 when unknown)."""
        ...


Tracer = Callable[..., AbstractContextManager[Any]]
"""``tracer(name, **attributes)`` -> context manager around one transition (a span)."""


def no_tracer(name: str, **attributes: Any) -> AbstractContextManager[None]:
    """The default :data:`Tracer`: does nothing."""
    return contextlib.nullcontext()
