"""Prefix aware: the replica whose prefix cache holds most of the prompt's leading tokens, within a load gap,
else the least loaded with new replicas warming up (:class:`~loadbalancer.prefix_index.PrefixPolicy` says
how the two are weighed). Every chosen replica's index learns the prompt."""

from __future__ import annotations

from collections.abc import Sequence

from ..prefix_index import PrefixPolicy
from .least_loaded import RoundRobin
from .policy import C, Candidate, Pick


class PrefixAware:
    """See the module docstring; always chooses, so it ends a chain."""

    def __init__(self, policy: PrefixPolicy) -> None:
        self.policy = policy
        self._ties = RoundRobin()

    def select(self, pick: Pick, routes: Sequence[C]) -> C:
        loads = self.policy.loads(routes, pick.now)
        if pick.prefix_keys:
            chosen, pick.prefix_tokens, pick.prefix_spilled = self.policy.affine(pick.prefix_keys, routes, loads)
            if chosen is not None:
                return chosen
        lightest = min(loads.values())
        return self._ties.among([r for r in routes if loads[r.replica_id] == lightest])

    def chosen(self, pick: Pick, route: Candidate) -> None:
        if pick.prefix_keys:
            self.policy.index.record(route.replica_id, pick.prefix_keys)

    def forget(self, replica_ids: set[str]) -> None:
        for replica_id in replica_ids:
            self.policy.index.forget(replica_id)
