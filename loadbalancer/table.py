"""The routing table, free of I/O: membership, tickets and the run of the routing pieces.

The table holds the replicas (routes), each request's claim on one (tickets) and the pieces of its policy
(:mod:`loadbalancer.routing`): filters take replicas out of a pick (a weight version too old, a breaker
open), then selectors choose (a session's pinned replica, the replica that caches most of the prompt, the
least loaded one). Removing a replica tells every piece at once (its sticky pins and prefix entries go) and
revokes the tickets of requests that picked it but have not been sent yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mesh_runtime.errors import AlreadyExists, InvalidArgument, NotFound
from mesh_runtime.reasons import Reason
from mesh_runtime.validate import check_address

from .prefix_index import PrefixPolicy, PromptKeys
from .routing.breaker import Breaker, Breakers, OutlierDetection
from .routing.least_loaded import LeastLoaded
from .routing.policy import Filter, Pick, Selector
from .routing.prefix_aware import PrefixAware
from .routing.prefix_cost import PrefixCost
from .routing.sticky import SessionAffinity
from .routing.version import VersionFloor

__all__ = ["Choice", "OutlierDetection", "Route", "RoutingTable", "Ticket"]


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
    breaker: Breaker = field(default_factory=Breaker)
    """Out of picks while open (outlier detection: :mod:`loadbalancer.routing.breaker`)."""
    joined_at: float = 0.0
    """When the table added the route, on the table's clock (a prefix-aware table warms new replicas up)."""
    paused: bool = False
    """Out of picks until resumed (a caller's pause_generation through the RL control plane)."""
    held_tokens: int = 0
    """The context of the replica's requests in flight (each its prompt plus its expected completion, the
    tickets' weights): a load in tokens, what its decode steps read."""

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
    weight: int = 0
    """The request's prompt plus its expected completion, from the pick (its part of :attr:`Route.held_tokens`)."""
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


class CompletionMean:
    """A running mean of completion lengths (exponentially weighted: recent requests count most), for the
    tokens a new request is expected to hold; ``initial`` until a request completes."""

    def __init__(self, initial: float = 256.0, weight: float = 0.02) -> None:
        self.mean = initial
        self.weight = weight

    def observe(self, tokens: int) -> None:
        self.mean += self.weight * (tokens - self.mean)

    def expected(self, max_tokens: int = 0) -> int:
        """Tokens a request is expected to generate (at most ``max_tokens`` when that is known)."""
        mean = round(self.mean)
        return min(mean, max_tokens) if max_tokens > 0 else mean


@dataclass
class Choice:
    """The result of a pick: the ticket, and how the selectors chose (``pick``'s notes)."""

    ticket: Ticket
    pick: Pick

    @property
    def sticky_hit(self) -> bool:
        return self.pick.sticky_hit

    @property
    def sticky_migrated(self) -> bool:
        return self.pick.sticky_migrated

    @property
    def prefix_tokens(self) -> int:
        return self.pick.prefix_tokens

    @property
    def prefix_spilled(self) -> bool:
        return self.pick.prefix_spilled


class RoutingTable:
    """Replicas, tickets and the routing pieces; every method is synchronous.

    ``selectors``: the chain that chooses (:func:`loadbalancer.routing.selectors` builds the configured one;
    default: least loaded); the last one must always choose."""

    def __init__(self, selectors: Sequence[Selector] = (), *, max_version_lag: int | None = None,
                 outlier: OutlierDetection | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.selectors: list[Selector] = list(selectors) or [LeastLoaded()]
        self.versions = VersionFloor(max_version_lag)
        self.breakers = Breakers(outlier or OutlierDetection())
        self.filters: list[Filter[Route]] = [self.breakers, self.versions]
        self.clock = clock
        self.routes: dict[str, Route] = {}
        self.sessions = next((s for s in self.selectors if isinstance(s, SessionAffinity)), None)
        """The chain's session affinity, if it has one (sticky pins)."""
        self.prefix: PrefixPolicy | PrefixCost | None = next(
            (s.policy if isinstance(s, PrefixAware) else s for s in self.selectors
             if isinstance(s, (PrefixAware, PrefixCost))), None)
        """The chain's prefix piece and its index, if it routes by prefix (the balancer keys prompts for it)."""
        self.completion_tokens = CompletionMean()
        """Tokens a request generates, as the completed ones did (what a new request is expected to hold)."""
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
        """Remove routes: revoke unsent tickets, tell every selector. Returns (removed, sticky pins dropped)."""
        removed = []
        for replica_id in replica_ids:
            route = self.routes.pop(replica_id, None)
            if route is not None:
                route.removed = True
                removed.append(route)
        pins = self.sticky_sessions
        gone = {r.replica_id for r in removed}
        if gone:
            for selector in self.selectors:
                selector.forget(gone)
            self._changed()
        return removed, pins - self.sticky_sessions

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
        return self.versions.floor(min_weight_version, self.newest_version if self.routes else None)

    def _pick(self, request_id: str = "", *, session_id: str = "", min_weight_version: int | None = None,
              prefix_keys: PromptKeys | None = None, prompt_tokens: int = 0, max_tokens: int = 0) -> Pick:
        return Pick(request_id, self.clock(), session_id=session_id, prefix_keys=prefix_keys,
                    min_weight_version=min_weight_version, newest_version=self.newest_version,
                    prompt_tokens=prompt_tokens, expected_completion=self.completion_tokens.expected(max_tokens))

    def unroutable_reason(self, route: Route, min_weight_version: int | None = None, *,
                          pick: Pick | None = None) -> str:
        """Why ``route`` is out of picks (for a request asking ``min_weight_version``); empty when it is in."""
        if route.removed:
            return "removed"
        if route.paused:
            return "paused (pause_generation)"
        pick = pick or self._pick(min_weight_version=min_weight_version)
        return next((why for why in (f.why_not(route, pick) for f in self.filters) if why), "")

    def eligible(self, min_weight_version: int | None, *, pick: Pick | None = None) -> list[Route]:
        pick = pick or self._pick(min_weight_version=min_weight_version)
        return [r for r in self.routes.values() if not self.unroutable_reason(r, pick=pick)]

    def admissible(self, min_weight_version: int | None, avoid: frozenset[str] = frozenset()) -> list[str]:
        """Ids of the replicas a request may be admitted to: the eligible ones and the paused ones (a pause
        holds requests; it does not move a session's program), less ``avoid`` while any other is left."""
        pick = self._pick(min_weight_version=min_weight_version)
        ids = [r.replica_id for r in self.routes.values()
               if not r.removed and (r.paused or not self.unroutable_reason(r, pick=pick))]
        return [i for i in ids if i not in avoid] or ids

    def explain_ineligible(self, min_weight_version: int | None) -> str:
        if not self.routes:
            return "the routing table is empty"
        pick = self._pick(min_weight_version=min_weight_version)
        return "; ".join(f"{r.replica_id}: {self.unroutable_reason(r, pick=pick)}" for r in self.routes.values())

    def pick(self, request_id: str, *, session_id: str = "", min_weight_version: int | None = None,
             avoid: frozenset[str] = frozenset(), prefix_keys: PromptKeys | None = None, prompt_tokens: int = 0,
             max_tokens: int = 0, only: frozenset[str] | None = None) -> Choice | None:
        """Claim the best eligible route for a request, or ``None`` if there is none.

        ``avoid``: replicas to pass over while another is eligible (ones this request failed on).
        ``prefix_keys``: the prompt's keys (:meth:`loadbalancer.prefix_index.PrefixIndex.prompt`), for a
        prefix-aware chain. ``prompt_tokens`` and ``max_tokens`` (0: not known) size the tokens the chosen
        replica holds for the request. ``only``: the replicas it may go to at all (program admission's)."""
        pick = self._pick(request_id, session_id=session_id, min_weight_version=min_weight_version,
                          prefix_keys=prefix_keys, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        candidates = self.eligible(None, pick=pick)
        if only is not None:
            candidates = [r for r in candidates if r.replica_id in only]
        preferred = [r for r in candidates if r.replica_id not in avoid] or candidates
        if not preferred:
            return None
        chosen = next(route for route in (s.select(pick, preferred) for s in self.selectors) if route is not None)
        for selector in self.selectors:
            selector.chosen(pick, chosen)
        weight = pick.held_weight or pick.prompt_tokens + pick.expected_completion
        ticket = Ticket(request_id, chosen, weight=weight)
        chosen.tickets[request_id] = ticket
        chosen.held_tokens += weight
        return Choice(ticket, pick)

    # ------------------------------------------------------ outlier detection
    def next_ejection_end(self) -> float | None:
        """Seconds until the soonest ejection ends (None: nothing is ejected)."""
        return self.breakers.next_close(self.routes.values(), self.clock())

    def answered(self, route: Route) -> None:
        """The replica answered an attempt (tokens or a final message): it is healthy again."""
        self.breakers.answered(route)

    def unreachable(self, route: Route, why: str) -> bool:
        """An attempt could not reach the replica; returns True when this ejected it (its breaker opened)."""
        opened = self.breakers.unreachable(route, why, list(self.routes.values()), self.clock())
        if opened:
            self._changed()
        return opened

    def release(self, ticket: Ticket, *, completed: bool = False, failed: bool = False) -> None:
        if ticket.route.tickets.get(ticket.request_id) is ticket:
            del ticket.route.tickets[ticket.request_id]
            ticket.route.held_tokens -= ticket.weight
            if completed:
                self.completion_tokens.observe(ticket.tokens)
        ticket.route.completed += int(completed)
        ticket.route.failed += int(failed)

    # -------------------------------------------------------------- sessions
    @property
    def sticky_sessions(self) -> int:
        return len(self.sessions) if self.sessions is not None else 0

    def sticky_count(self, replica_id: str) -> int:
        return self.sessions.count(replica_id) if self.sessions is not None else 0

    def sticky_replica(self, session_id: str) -> str | None:
        return self.sessions.replica(session_id) if self.sessions is not None else None

    def drop_session(self, session_id: str) -> str | None:
        """Forget a session's pin; the replica it was pinned to, if any."""
        return self.sessions.drop(session_id) if self.sessions is not None else None

    def clear_sticky(self, replica_ids: Iterable[str] = ()) -> int:
        return self.sessions.clear(replica_ids) if self.sessions is not None else 0

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
