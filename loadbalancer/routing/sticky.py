"""Session affinity with bounded load: a session sticks to the replica it was routed to until that replica
carries more than ``max_load_gap`` requests above the least loaded eligible one; then the session moves (and
sticks to its new replica). Pins are kept least recently used first, at most ``max_sessions`` of them, and
one unused for ``idle_s`` is dropped. With ``steers`` False it only records where each session's last request
went (a policy that pins no sessions still lets CloseSession and the KV hold reach a session's replica) and
never chooses. Either way it tells the pick where the session's last request went and how long its prompt
was, for a policy that weighs what a replica has cached."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .policy import C, Candidate, Pick


class _Pin(NamedTuple):
    replica_id: str
    used: float
    """When the session last picked."""
    prompt_tokens: int
    """Its last request's prompt, which the replica prefilled."""


class SessionAffinity:
    """See the module docstring; a pick without a session id passes to the next selector."""

    def __init__(self, *, max_load_gap: int, max_sessions: int, idle_s: float | None, steers: bool = True) -> None:
        self.max_load_gap = max_load_gap
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.steers = steers
        self._pins: OrderedDict[str, _Pin] = OrderedDict()
        """Session -> its pin, least recently used first."""

    def select(self, pick: Pick, routes: Sequence[C]) -> C | None:
        if not pick.session_id:
            return None
        self._expire(pick.now)
        pin = self._pins.get(pick.session_id)
        if pin is None:
            return None
        pick.session_replica, pick.session_tokens = pin.replica_id, pin.prompt_tokens
        if not self.steers:
            return None
        route = next((r for r in routes if r.replica_id == pin.replica_id), None)
        if route is None:
            return None
        if route.in_flight - min(r.in_flight for r in routes) <= self.max_load_gap:
            pick.sticky_hit = True
            return route
        pick.sticky_migrated = True
        return None

    def chosen(self, pick: Pick, route: Candidate) -> None:
        if not pick.session_id:
            return
        self._pins[pick.session_id] = _Pin(route.replica_id, pick.now, pick.prompt_tokens)
        self._pins.move_to_end(pick.session_id)
        while len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)

    def forget(self, replica_ids: set[str]) -> None:
        self.clear(replica_ids)

    # -------------------------------------------------------------- sessions
    def __len__(self) -> int:
        return len(self._pins)

    def count(self, replica_id: str) -> int:
        return sum(1 for pin in self._pins.values() if pin.replica_id == replica_id)

    def replica(self, session_id: str) -> str | None:
        pin = self._pins.get(session_id)
        return pin.replica_id if pin is not None else None

    def drop(self, session_id: str) -> str | None:
        """Forget a session's pin; the replica it was pinned to, if any."""
        pin = self._pins.pop(session_id, None)
        return pin.replica_id if pin is not None else None

    def clear(self, replica_ids: Iterable[str] = ()) -> int:
        """Drop the pins to these replicas (all pins when none are named); how many were dropped."""
        ids = set(replica_ids)
        doomed = [s for s, pin in self._pins.items() if not ids or pin.replica_id in ids]
        for session in doomed:
            del self._pins[session]
        return len(doomed)

    def _expire(self, now: float) -> None:
        """Drop pins unused for ``idle_s`` (least recently used first: they lead the order)."""
        if self.idle_s is None:
            return
        horizon = now - self.idle_s
        while self._pins:
            session, pin = next(iter(self._pins.items()))
            if pin.used > horizon:
                break
            del self._pins[session]
