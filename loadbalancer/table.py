"""The routing table and the routing policy, free of I/O.

Routing picks, among routable replicas that satisfy the request's weight
version, the one with the fewest in-flight requests; ties are broken round
robin (a rotating cursor over the tied replicas, in id order), so new
sessions spread evenly instead of piling onto the first replica. A session sticks to the replica it was
routed to until that replica carries more than ``sticky_max_load_gap``
requests above the least loaded eligible one (bounded-load affinity). A
prefix-aware table (:class:`~.prefix_index.PrefixPolicy`) sends a request
without a pinned session to the replica that holds most of its prompt's
leading blocks, within a load gap. Removing a replica drops its sticky pins
and its prefix entries at once and revokes the tickets of requests that
picked it but have not been sent yet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh_runtime.errors import AlreadyExists, InvalidArgument, NotFound
from mesh_runtime.reasons import Reason
from mesh_runtime.validate import check_address

from .prefix_index import PrefixPolicy

log = logging.getLogger(__name__)


@dataclass
class Route:
    """One replica in the table and its routing counters."""

    replica_id: str
    address: str
    kind: str = "STANDALONE"
    weight_version: int = 0
    node_id: str = ""
    added_at: float = field(default_factory=time.time)
    tickets: dict[str, Ticket] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    removed: bool = False
    consecutive_failures: int = 0
    """Attempts in a row that failed to reach the replica (UNAVAILABLE, a broken or stalled stream)."""
    ejections: int = 0
    """Ejections since the replica last answered; each one lasts longer (outlier detection)."""
    ejected_until: float = 0.0
    """``time.monotonic()`` until which the replica is out of picks (0: not ejected)."""
    ejected_reason: str = ""
    joined_at: float = 0.0
    """When the table added the route, on the table's clock (a prefix-aware table warms new replicas up)."""
    paused: bool = False
    """Out of picks until resumed (a caller's pause_generation through the RL control plane)."""

    @property
    def in_flight(self) -> int:
        return len(self.tickets)


@dataclass
class Ticket:
    """A request's claim on a route, from pick until the attempt ends."""

    request_id: str
    route: Route
    sent: bool = False
    tokens: int = 0
    move_requested: bool = False
    cut_reason: str = ""
    """Why the balancer cut this attempt (its replica was removed with abort); set by :meth:`cut`."""
    on_cut: Callable[[str], None] | None = None
    """Set while the attempt's call runs: ends that call (the attempt's watch)."""

    def cut(self, reason: str) -> None:
        """End the attempt locally: its stream is dropped and the request resumes elsewhere."""
        self.cut_reason = reason
        if self.on_cut is not None:
            self.on_cut(reason)

    @property
    def revoked(self) -> bool:
        return self.route.removed


@dataclass(frozen=True)
class OutlierDetection:
    """Envoy-style ejection of replicas that keep failing (see the balancer config's ``outlier_detection``)."""

    consecutive_failures: int = 3
    base_ejection_s: float = 5.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0


@dataclass
class Choice:
    """The result of a pick: the ticket and how stickiness played out."""

    ticket: Ticket
    sticky_hit: bool = False
    sticky_migrated: bool = False
    prefix_blocks: int = 0
    """Leading prompt blocks the chosen replica was found to hold (prefix-aware routing)."""
    prefix_spilled: bool = False
    """A replica held part of the prompt but was too loaded (prefix-aware routing)."""


class RoutingTable:
    """Replicas, sticky sessions and tickets; every method is synchronous."""

    def __init__(self, *, sticky_max_load_gap: int, max_sticky_sessions: int, max_version_lag: int | None,
                 outlier: OutlierDetection | None = None, clock: Callable[[], float] = time.monotonic,
                 sticky_idle_s: float | None = None, prefix: PrefixPolicy | None = None) -> None:
        """``prefix``: route by cached prompt prefix (``routing_policy: prefix_aware``); None: by load."""
        self.prefix = prefix
        self.sticky_max_load_gap = sticky_max_load_gap
        self.max_sticky_sessions = max_sticky_sessions
        self.sticky_idle_s = sticky_idle_s
        self.max_version_lag = max_version_lag
        self.outlier = outlier or OutlierDetection()
        self.clock = clock
        self._tie_cursor = itertools.count()
        self.routes: dict[str, Route] = {}
        self._sticky: OrderedDict[str, tuple[str, float]] = OrderedDict()
        """Session -> (replica it is pinned to, when it was last used), least recently used first."""
        self._listeners: list[Callable[[], None]] = []

    # ----------------------------------------------------------- membership
    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever replicas are added, removed or updated."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def add(self, endpoints: Iterable[Route]) -> list[Route]:
        """Add routes; the same id at the same address is a no-op. Validates all first."""
        endpoints = list(endpoints)
        seen: set[str] = set()
        for ep in endpoints:
            if not ep.replica_id:
                raise InvalidArgument("replica_id must not be empty", reason=Reason.EMPTY_REPLICA_ID)
            if ep.replica_id in seen:
                raise InvalidArgument(f"replica {ep.replica_id!r} is listed twice", reason=Reason.DUPLICATE_REPLICA)
            seen.add(ep.replica_id)
            check_address(ep.address, f"replica {ep.replica_id!r} address")
            existing = self.routes.get(ep.replica_id)
            if existing is not None and existing.address != ep.address:
                raise AlreadyExists(f"replica {ep.replica_id!r} is already routed at {existing.address}; "
                                    "use UpdateReplicas to change its address", reason=Reason.REPLICA_EXISTS)
        added = []
        for ep in endpoints:
            existing = self.routes.get(ep.replica_id)
            if existing is None:
                self.routes[ep.replica_id] = ep
                ep.joined_at = self.clock()
                existing = ep
            else:
                existing.weight_version = max(existing.weight_version, ep.weight_version)
            added.append(existing)
        self._changed()
        return added

    def remove(self, replica_ids: Iterable[str]) -> tuple[list[Route], int]:
        """Remove routes: revoke unsent tickets, drop sticky pins. Returns (removed, pins dropped)."""
        removed = []
        for replica_id in replica_ids:
            route = self.routes.pop(replica_id, None)
            if route is not None:
                route.removed = True
                removed.append(route)
        gone = {r.replica_id for r in removed}
        if self.prefix is not None:
            for replica_id in gone:
                self.prefix.index.forget(replica_id)
        dropped = [s for s, (rid, _) in self._sticky.items() if rid in gone]
        for session in dropped:
            del self._sticky[session]
        if removed:
            self._changed()
        return removed, len(dropped)

    def update(self, replica_id: str, *, weight_version: int | None = None, address: str | None = None) -> Route:
        route = self.get(replica_id)
        if weight_version is not None and weight_version > route.weight_version:
            route.weight_version = weight_version
        if address is not None:
            route.address = address
        self._changed()
        return route

    def set_paused(self, replica_ids: Iterable[str], paused: bool) -> list[Route]:
        """Pause (out of picks) or resume routes; the ones whose state changed."""
        changed = [r for r in (self.routes.get(i) for i in replica_ids) if r is not None and r.paused != paused]
        for route in changed:
            route.paused = paused
        if changed:
            self._changed()
        return changed

    @property
    def any_paused(self) -> bool:
        return any(r.paused for r in self.routes.values())

    def get(self, replica_id: str) -> Route:
        route = self.routes.get(replica_id)
        if route is None:
            raise NotFound(f"replica {replica_id!r} is not in the routing table", reason=Reason.REPLICA_NOT_FOUND,
                           metadata={"replica_id": replica_id})
        return route

    def observe_version(self, route: Route, version: int) -> None:
        """Learn a replica's weight version from its own output."""
        if version > route.weight_version:
            route.weight_version = version
            self._changed()

    # --------------------------------------------------------------- routing
    @property
    def newest_version(self) -> int:
        return max((r.weight_version for r in self.routes.values()), default=0)

    def version_floor(self, min_weight_version: int | None) -> int | None:
        floors = []
        if min_weight_version is not None:
            floors.append(min_weight_version)
        if self.max_version_lag is not None and self.routes:
            floors.append(self.newest_version - self.max_version_lag)
        return max(floors) if floors else None

    def unroutable_reason(self, route: Route, floor: int | None) -> str:
        if route.removed:
            return "removed"
        if route.paused:
            return "paused (pause_generation)"
        if route.ejected_until:
            left = route.ejected_until - self.clock()
            if left > 0:
                return f"ejected for {left:.1f} s more: {route.ejected_reason}"
        if floor is not None and route.weight_version < floor:
            return f"weight_version {route.weight_version} < required {floor}"
        return ""

    def eligible(self, min_weight_version: int | None) -> list[Route]:
        floor = self.version_floor(min_weight_version)
        return [r for r in self.routes.values() if not self.unroutable_reason(r, floor)]

    def explain_ineligible(self, min_weight_version: int | None) -> str:
        floor = self.version_floor(min_weight_version)
        if not self.routes:
            return "the routing table is empty"
        return "; ".join(f"{r.replica_id}: {self.unroutable_reason(r, floor)}" for r in self.routes.values())

    def pick(self, request_id: str, *, session_id: str = "", min_weight_version: int | None = None,
             avoid: frozenset[str] = frozenset(), prefix_keys: Sequence[int] = ()) -> Choice | None:
        """Claim the best eligible route for a request, or ``None`` if there is none.

        ``prefix_keys``: the prompt's leading block keys (:func:`mesh_runtime.prefix.block_keys`), for a
        prefix-aware table."""
        candidates = self.eligible(min_weight_version)
        preferred = [r for r in candidates if r.replica_id not in avoid] or candidates
        if not preferred:
            return None
        least = min(r.in_flight for r in preferred)
        choice_kw: dict[str, Any] = {}
        chosen = None
        if session_id:
            self._expire_sticky()
            pinned = self.routes.get(self.sticky_replica(session_id) or "")
            if pinned is not None and pinned in preferred:
                if pinned.in_flight - least <= self.sticky_max_load_gap:
                    chosen, choice_kw = pinned, {"sticky_hit": True}
                else:
                    choice_kw = {"sticky_migrated": True}
        if chosen is None and self.prefix is not None:
            loads = self.prefix.loads(preferred, self.clock())
            if prefix_keys:
                chosen, blocks, spilled = self.prefix.affine(prefix_keys, preferred, loads)
                choice_kw.update(prefix_blocks=blocks, prefix_spilled=spilled)
            if chosen is None:
                lightest = min(loads.values())
                chosen = self._tie_break([r for r in preferred if loads[r.replica_id] == lightest])
        if chosen is None:
            chosen = self._tie_break([r for r in preferred if r.in_flight == least])
        if self.prefix is not None and prefix_keys:
            self.prefix.index.record(chosen.replica_id, prefix_keys)
        if session_id:
            self._sticky[session_id] = (chosen.replica_id, self.clock())
            self._sticky.move_to_end(session_id)
            while len(self._sticky) > self.max_sticky_sessions:
                self._sticky.popitem(last=False)
        ticket = Ticket(request_id, chosen)
        chosen.tickets[request_id] = ticket
        return Choice(ticket, **choice_kw)

    def _tie_break(self, tied: list[Route]) -> Route:
        """Round robin over equally good routes (in id order), so new work spreads evenly."""
        tied.sort(key=lambda r: r.replica_id)
        return tied[next(self._tie_cursor) % len(tied)]

    # ------------------------------------------------------ outlier detection
    def next_ejection_end(self) -> float | None:
        """Seconds until the soonest ejection ends (None: nothing is ejected)."""
        now = self.clock()
        ends = [r.ejected_until - now for r in self.routes.values() if r.ejected_until > now]
        return min(ends) if ends else None

    def answered(self, route: Route) -> None:
        """The replica answered an attempt (tokens or a final message): it is healthy again."""
        if route.ejections:
            log.info("replica %s answered after %d ejection(s): back in picks", route.replica_id, route.ejections,
                     extra={"replica_id": route.replica_id})
        route.consecutive_failures = 0
        route.ejections = 0
        route.ejected_until = 0.0

    def unreachable(self, route: Route, why: str) -> bool:
        """An attempt could not reach the replica; returns True when this ejected it.

        After ``consecutive_failures`` in a row the replica leaves picks for
        ``base_ejection_s`` x the number of its ejections (at most
        ``max_ejection_s``), unless that would eject more than
        ``max_ejection_percent`` of the table (always leaving one replica).
        When an ejection ends the replica gets one attempt: a failure ejects
        it again at once, for longer; an answer clears it.
        """
        route.consecutive_failures += 1
        od = self.outlier
        if route.removed or route.consecutive_failures < od.consecutive_failures:
            return False
        now = self.clock()
        if route.ejected_until > now:
            return False
        ejected = sum(1 for r in self.routes.values() if r.ejected_until > now)
        allowed = max(1, int(len(self.routes) * od.max_ejection_percent / 100))
        if ejected >= min(allowed, len(self.routes) - 1):
            log.info("replica %s not ejected after %d consecutive failures: %d of %d replicas are ejected "
                     "already (max_ejection_percent %g, never the last one)", route.replica_id,
                     route.consecutive_failures, ejected, len(self.routes), od.max_ejection_percent,
                     extra={"replica_id": route.replica_id})
            return False
        route.ejections += 1
        route.ejected_until = now + min(od.base_ejection_s * route.ejections, od.max_ejection_s)
        route.ejected_reason = f"{route.consecutive_failures} consecutive failures, last: {why[:120]}"
        route.consecutive_failures = od.consecutive_failures - 1   # one more failure after it ends re-ejects
        self._changed()
        return True

    def release(self, ticket: Ticket, *, completed: bool = False, failed: bool = False) -> None:
        if ticket.route.tickets.get(ticket.request_id) is ticket:
            del ticket.route.tickets[ticket.request_id]
        ticket.route.completed += int(completed)
        ticket.route.failed += int(failed)

    # -------------------------------------------------------------- sessions
    @property
    def sticky_sessions(self) -> int:
        return len(self._sticky)

    def sticky_count(self, replica_id: str) -> int:
        return sum(1 for rid, _ in self._sticky.values() if rid == replica_id)

    def sticky_replica(self, session_id: str) -> str | None:
        pin = self._sticky.get(session_id)
        return pin[0] if pin is not None else None

    def drop_session(self, session_id: str) -> str | None:
        """Forget a session's pin; the replica it was pinned to, if any."""
        pin = self._sticky.pop(session_id, None)
        return pin[0] if pin is not None else None

    def _expire_sticky(self) -> None:
        """Drop pins unused for ``sticky_idle_s`` (least recently used first: they lead the order)."""
        if self.sticky_idle_s is None:
            return
        horizon = self.clock() - self.sticky_idle_s
        while self._sticky:
            session, (_, used) = next(iter(self._sticky.items()))
            if used > horizon:
                break
            del self._sticky[session]

    def clear_sticky(self, replica_ids: Iterable[str] = ()) -> int:
        ids = set(replica_ids)
        doomed = [s for s, (rid, _) in self._sticky.items() if not ids or rid in ids]
        for session in doomed:
            del self._sticky[session]
        return len(doomed)

    # ------------------------------------------------------------- rebalance
    def plan_moves(self, max_moves: int | None) -> list[Ticket]:
        """Tickets to move so no eligible replica carries more than its fair share.

        The fair share is ``ceil(total / replicas)``; from each replica above it
        the sent requests with the fewest tokens so far move (cheapest to redo).
        """
        routes = self.eligible(None)
        total = sum(r.in_flight for r in routes)
        share = -(-total // len(routes)) if routes else 0
        moves: list[Ticket] = []
        for route in sorted(routes, key=lambda r: -r.in_flight):
            excess = route.in_flight - share
            if excess <= 0:
                continue
            movable = sorted((t for t in route.tickets.values() if t.sent and not t.move_requested),
                             key=lambda t: t.tokens)
            moves += movable[:excess]
        return moves[:max_moves] if max_moves is not None else moves
