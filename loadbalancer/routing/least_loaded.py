"""Least loaded: the replica with the fewest requests in flight; ties broken round robin (a rotating cursor
over the tied replicas in id order), so new work spreads evenly instead of piling onto the first replica."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .policy import C, Candidate, Pick


class RoundRobin:
    """The tie-break shared by the selectors that end a chain."""

    def __init__(self) -> None:
        self._cursor = itertools.count()

    def among(self, tied: list[C]) -> C:
        tied.sort(key=lambda r: r.replica_id)
        return tied[next(self._cursor) % len(tied)]


class LeastLoaded:
    """See the module docstring; always chooses, so it ends a chain."""

    def __init__(self) -> None:
        self._ties = RoundRobin()

    def select(self, pick: Pick, routes: Sequence[C]) -> C:
        least = min(r.in_flight for r in routes)
        return self._ties.among([r for r in routes if r.in_flight == least])

    def chosen(self, pick: Pick, route: Candidate) -> None:
        pass

    def forget(self, replica_ids: set[str]) -> None:
        pass
