"""A routing policy written as a plug-in would write it (used by test_routing_pieces.py): the replica that
has completed the fewest requests, ties to the lowest id. Registering it is one line:
``routing.register("fewest_completed", lambda config: FewestCompleted())``."""

from __future__ import annotations

from collections.abc import Sequence

from loadbalancer.routing import Pick
from loadbalancer.table import Route


class FewestCompleted:
    def __init__(self) -> None:
        self.chose: list[str] = []

    def select(self, pick: Pick, routes: Sequence[Route]) -> Route:
        return min(routes, key=lambda r: (r.completed, r.replica_id))

    def chosen(self, pick: Pick, route: Route) -> None:
        self.chose.append(route.replica_id)

    def forget(self, replica_ids: set[str]) -> None:
        self.chose = [r for r in self.chose if r not in replica_ids]
