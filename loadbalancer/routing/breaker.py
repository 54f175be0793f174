"""A circuit breaker per route: Envoy-style ejection of replicas that keep failing.

After ``consecutive_failures`` attempts in a row that could not reach a replica, its breaker opens for
``base_ejection_s`` x the number of its ejections (at most ``max_ejection_s``), unless that would open more
than ``max_ejection_percent`` of the table's breakers (always leaving one replica). When it closes again the
replica gets one attempt (half open): a failure opens it at once, for longer; an answer resets it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from .policy import Candidate, Pick

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutlierDetection:
    """The breakers' settings (the balancer config's ``outlier_detection``)."""

    consecutive_failures: int = 3
    base_ejection_s: float = 5.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0


@dataclass
class Breaker:
    """One route's breaker."""

    consecutive_failures: int = 0
    """Attempts in a row that failed to reach the replica (UNAVAILABLE, a broken or stalled stream)."""
    ejections: int = 0
    """Ejections since the replica last answered; each one lasts longer."""
    ejected_until: float = 0.0
    """Clock time until which the replica is out of picks (0: not ejected)."""
    ejected_reason: str = ""

    def open_at(self, now: float) -> bool:
        return self.ejected_until > now


class Guarded(Candidate, Protocol):
    """A replica with a breaker (:class:`loadbalancer.table.Guarded`)."""

    @property
    def breaker(self) -> Breaker: ...

    @property
    def removed(self) -> bool: ...


class Breakers:
    """The table's filter over its routes' breakers, and the fleet-wide rule on how many may be open."""

    def __init__(self, settings: OutlierDetection) -> None:
        self.settings = settings

    def why_not(self, route: Guarded, pick: Pick) -> str:
        left = route.breaker.ejected_until - pick.now
        return f"ejected for {left:.1f} s more: {route.breaker.ejected_reason}" if left > 0 else ""

    @staticmethod
    def next_close(routes: Collection[Guarded], now: float) -> float | None:
        """Seconds until the soonest open breaker closes (None: none is open)."""
        ends = [r.breaker.ejected_until - now for r in routes if r.breaker.open_at(now)]
        return min(ends) if ends else None

    @staticmethod
    def answered(route: Guarded) -> None:
        """The replica answered an attempt (tokens or a final message): its breaker resets."""
        breaker = route.breaker
        if breaker.ejections:
            log.info("replica %s answered after %d ejection(s): back in picks", route.replica_id,
                     breaker.ejections, extra={"replica_id": route.replica_id})
        breaker.consecutive_failures = breaker.ejections = 0
        breaker.ejected_until = 0.0

    def unreachable(self, route: Guarded, why: str, routes: Collection[Guarded], now: float) -> bool:
        """An attempt could not reach ``route`` (one of ``routes``, the table); True when its breaker opened."""
        breaker, settings = route.breaker, self.settings
        breaker.consecutive_failures += 1
        if route.removed or breaker.consecutive_failures < settings.consecutive_failures:
            return False
        if breaker.open_at(now):
            return False
        opened = sum(1 for r in routes if r.breaker.open_at(now))
        allowed = max(1, int(len(routes) * settings.max_ejection_percent / 100))
        if opened >= min(allowed, len(routes) - 1):
            log.info("replica %s not ejected after %d consecutive failures: %d of %d replicas are ejected "
                     "already (max_ejection_percent %g, never the last one)", route.replica_id,
                     breaker.consecutive_failures, opened, len(routes), settings.max_ejection_percent,
                     extra={"replica_id": route.replica_id})
            return False
        breaker.ejections += 1
        breaker.ejected_until = now + min(settings.base_ejection_s * breaker.ejections, settings.max_ejection_s)
        breaker.ejected_reason = f"{breaker.consecutive_failures} consecutive failures, last: {why[:120]}"
        breaker.consecutive_failures = settings.consecutive_failures - 1   # one more failure after it re-opens
        return True
