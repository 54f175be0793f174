"""The registered load balancers: a membership with leases, I/O-free.

A balancer registers with the controller and renews its lease by registering
again (a heartbeat); the controller keeps the routing table of every member
in line with the replica registry, and clients read the members to spread
requests over them. A member that stops renewing for ``lease_ttl_s`` is
dropped (and its lapse recorded as an event); registering again makes it a
member anew. Membership is durable: a controller that takes over (a restart,
a standby winning the store) restores it and gives every member a fresh lease,
as the node registry does, so a failover does not make clients lose their
balancers. Lease renewals are not written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mesh_runtime.reasons import Reason
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .errors import AlreadyExistsError, NotFoundError
from .events import EventType
from .leases import Lease, Lessor

Clock = Callable[[], float]


@dataclasses.dataclass
class BalancerMember:
    """One registered load balancer."""

    balancer_id: str
    address: str
    version: str = ""
    registered_at: float = 0.0
    instance_id: str = ""
    """The run of the balancer process: a new one (a restarted balancer) starts with an empty table."""
    lease: Lease = dataclasses.field(default_factory=Lease)
    """Its lease (:mod:`controller.core.leases`): renewed by each registration, its heartbeat."""

    @property
    def lease_expires_at(self) -> float:
        return self.lease.expires_at

    def to_document(self) -> state_pb2.Balancer:
        return state_pb2.Balancer(balancer_id=self.balancer_id, address=self.address, version=self.version,
                                  registered_at=self.registered_at, instance_id=self.instance_id)


class BalancerRegistry:
    """The members, by id, each with a lease of ``lease_ttl_s`` from its latest registration."""

    def __init__(self, *, clock: Clock, emit: Callable[..., Any] | None = None, lease_ttl_s: float = 10.0) -> None:
        self._clock = clock
        self._emit = emit or (lambda *args, **kwargs: None)
        self.leases = Lessor(lease_ttl_s, clock)
        """The members' leases (:mod:`controller.core.leases`)."""
        self._members: dict[str, BalancerMember] = {}
        self.ready: set[str] = set()
        """Addresses of the balancers (registered or configured) whose table a reconcile round filled and that
        answered the latest round: the ones clients should send requests to. Durable, so a standby and the
        next leader know them (a failover does not empty any balancer's table)."""

    @property
    def lease_ttl_s(self) -> float:
        return self.leases.ttl_s

    def register(self, balancer_id: str, address: str, version: str = "",
                 instance_id: str = "") -> tuple[BalancerMember, bool, bool]:
        """Add the balancer or renew its lease; ``(member, membership changed, table may be empty)``. A new
        address for a known id (the balancer moved) is a change; a new ``instance_id`` (it restarted) leaves the
        membership alone but makes it not ready until its table is filled again; an address another member has
        is ``ALREADY_EXISTS``."""
        now = self._clock()
        for other in self._members.values():
            if other.address == address and other.balancer_id != balancer_id:
                raise AlreadyExistsError(
                    f"address {address[:80]} is registered by balancer {other.balancer_id!r}; give each balancer "
                    "its own address, or deregister the other first", reason=Reason.BALANCER_ADDRESS_TAKEN,
                    metadata={"balancer_id": other.balancer_id})
        member = self._members.get(balancer_id)
        changed = member is None or member.address != address
        fresh = changed or member is None or member.instance_id != instance_id
        if member is None:
            member = self._members[balancer_id] = BalancerMember(balancer_id, address, version, registered_at=now)
        elif changed:
            self.ready.discard(member.address)
            member.address = address
        if fresh:
            self.ready.discard(address)
        member.version, member.instance_id = version, instance_id
        member.lease = self.leases.grant(now)
        if changed:
            self._emit(EventType.BALANCER_REGISTERED, reason=f"balancer {balancer_id} registered at {address}",
                       attributes={"balancer_id": balancer_id, "address": address})
        return member, changed, fresh

    def deregister(self, balancer_id: str, reason: str = "") -> BalancerMember:
        member = self.get(balancer_id)
        del self._members[balancer_id]
        self.ready.discard(member.address)
        self._emit(EventType.BALANCER_DEREGISTERED, reason=reason or f"balancer {balancer_id} deregistered",
                   attributes={"balancer_id": balancer_id, "address": member.address})
        return member

    def expire(self, now: float | None = None) -> list[BalancerMember]:
        """Drop every member whose lease ran out; returns them."""
        lapsed = self.leases.lapse(((m, m.lease) for m in self.members()), now)
        for member in lapsed:
            del self._members[member.balancer_id]
            self.ready.discard(member.address)
            self._emit(EventType.BALANCER_LEASE_EXPIRED,
                       reason=f"balancer {member.balancer_id} at {member.address} sent no heartbeat for "
                              f"{self.lease_ttl_s:g} s; dropped from routing",
                       attributes={"balancer_id": member.balancer_id, "address": member.address})
        return lapsed

    def get(self, balancer_id: str) -> BalancerMember:
        try:
            return self._members[balancer_id]
        except KeyError:
            raise NotFoundError(f"balancer {balancer_id[:64]!r} is not registered",
                                reason=Reason.BALANCER_NOT_FOUND) from None

    def members(self) -> list[BalancerMember]:
        return sorted(self._members.values(), key=lambda m: m.balancer_id)

    def addresses(self) -> list[str]:
        return [m.address for m in self.members()]

    def set_ready(self, address: str, ready: bool) -> bool:
        """Record whether the balancer at ``address`` has its table filled and answers; True when that changed."""
        if ready == (address in self.ready):
            return False
        if ready:
            self.ready.add(address)
        else:
            self.ready.discard(address)
        return True

    def to_document(self) -> state_pb2.BalancersDocument:
        return state_pb2.BalancersDocument(members=[m.to_document() for m in self.members()],
                                           ready=sorted(self.ready))

    def restore(self, document: state_pb2.BalancersDocument) -> None:
        """Restore the members; each gets a fresh lease from now."""
        self._members = {m.balancer_id: BalancerMember(m.balancer_id, m.address, m.version, m.registered_at,
                                                       m.instance_id, lease=self.leases.grant())
                         for m in document.members}
        self.ready = set(document.ready)
