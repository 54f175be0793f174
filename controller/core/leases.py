"""Leases: how the controller tells a live holder from a silent one, for nodes and balancers alike.

A holder (a replica agent's node, a registered balancer) is granted a lease of ``ttl_s`` when it registers and
renews it while it keeps calling (load reports, heartbeats); a lease whose expiry passes without a renewal
lapses, and what the holder had (its replicas' routing, its place among the balancers) is taken away by its
registry. A lapsed lease is not renewed: the holder registers again and is granted a new one. Renewals are
not durable: a controller that restores its state (a restart, a standby taking over) gives every lease that
was held a fresh ``ttl_s`` from then, so holders have time to reach the new leader before anything lapses.

One :class:`Lessor` per registry does this on the controller's clock; it is I/O-free and owns no holders
(each registry keeps its records, each with its :class:`Lease`), like etcd's lessor without the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TypeVar

from mesh_runtime.reasons import Reason

from .errors import FailedPreconditionError, InvalidArgumentError

Clock = Callable[[], float]
K = TypeVar("K")


@dataclasses.dataclass
class Lease:
    """One holder's lease: held until ``expires_at`` unless renewed; once lapsed, never held again."""

    expires_at: float = 0.0
    held: bool = True


class Lessor:
    """Grants, renews, lapses and restores leases of ``ttl_s`` on ``clock``."""

    def __init__(self, ttl_s: float, clock: Clock) -> None:
        if ttl_s <= 0:
            raise InvalidArgumentError(f"lease_ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = float(ttl_s)
        self._clock = clock

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def grant(self, now: float | None = None) -> Lease:
        """A new lease, held for ``ttl_s`` from ``now`` (a registration)."""
        return Lease(expires_at=self._now(now) + self.ttl_s)

    def renew(self, lease: Lease, kind: str, holder_id: str, now: float | None = None) -> float:
        """Extend a held lease by ``ttl_s`` from ``now``; its new expiry. A lapsed one is FAILED_PRECONDITION
        (``LEASE_EXPIRED``): the holder (a ``kind`` named ``holder_id``) must register again."""
        if not lease.held:
            raise FailedPreconditionError(f"the lease of {kind} {holder_id[:64]!r} expired at {lease.expires_at}; "
                                          f"register the {kind} again", reason=Reason.LEASE_EXPIRED)
        lease.expires_at = self._now(now) + self.ttl_s
        return lease.expires_at

    def lapse(self, leases: Iterable[tuple[K, Lease]], now: float | None = None) -> list[K]:
        """The holders whose held lease ran out by ``now``, in the order given; each lease is marked lapsed."""
        now = self._now(now)
        lapsed: list[K] = []
        for holder, lease in leases:
            if lease.held and lease.expires_at <= now:
                lease.held = False
                lapsed.append(holder)
        return lapsed

    def restore(self, lease: Lease, now: float | None = None) -> Lease:
        """A lease as restored from the store: a held one gets at least ``ttl_s`` from ``now``."""
        if lease.held:
            lease.expires_at = max(lease.expires_at, self._now(now) + self.ttl_s)
        return lease
