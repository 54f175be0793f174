"""Prefix cost: the replica where a request costs least in tokens, counting the work each replica already
holds, with no replica loaded past a bound (consistent hashing with bounded loads, applied to tokens).

A replica *holds* the context of its requests in flight: each one's prompt plus its expected completion (the
table's running mean of completions, capped by ``max_tokens``), which its decode steps read, plus
``prefill_load`` times the prompt tokens the request found uncached there, which it must prefill first. So a
replica taking many new prompts counts as busier than one holding the same context already cached (a prompt
token prefilled costs about what two tokens of context cost over a response's decode steps, on the engine
model's figures: 33 us against 51 ns x a few hundred iterations). Sending a request to replica ``r`` costs::

    held(r) + prefill_weight x uncached(r)

where ``uncached(r)`` is the prompt past the longest prefix ``r``'s index holds, the tokens ``r`` must
prefill. The cheapest replica wins, among those whose held tokens with this request (its weight there) stay
within ``(1 + max_load_excess)`` times the fleet's mean. ``prefill_weight`` (32) makes a cached context worth
keeping against a moderate imbalance: a trajectory stays where its context is cached, a GRPO group together,
until that replica passes the bound or is lighter elsewhere by more than the prefill a move costs; a prompt
many share then spreads onto as many replicas as its load needs, each prefilling it once. Load counts tokens,
not requests: a replica holding a few long contexts is as loaded as one holding many short ones.

It pins no sessions: a trajectory's next turn goes where its context is cached, by cost (the index learned
it when the previous turn was routed). The session's affinity is bounded by load the same way: the replica
its last request went to counts as holding that request's prompt (as much of this one as it covers), since
a session's next turn extends its last, whatever the index still holds or the prompt's blocks divide; so a
session stays on its replica while that replica is within the bound and no other is lighter by more than the
prefill a move costs. Without a prompt, an index match or a session every replica costs what it holds, so
it is least loaded in tokens, and with nothing held least loaded in requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..prefix_index import PrefixIndex
from .least_loaded import RoundRobin
from .policy import C, Candidate, Pick


class PrefixCost:
    """See the module docstring; always chooses, so it ends a chain."""

    def __init__(self, index: PrefixIndex, *, prefill_weight: float, max_load_excess: float,
                 prefill_load: float) -> None:
        self.index = index
        self.prefill_load = prefill_load
        self.prefill_weight = prefill_weight
        self.max_load_excess = max_load_excess
        self._ties = RoundRobin()

    def select(self, pick: Pick, routes: Sequence[C]) -> C:
        matched = self.index.match(pick.prefix_keys, [r.replica_id for r in routes]) if pick.prefix_keys else {}
        cached = dict(matched)
        if pick.session_replica:   # the session's next turn is expected to extend its last one, prefilled there
            cached[pick.session_replica] = max(cached.get(pick.session_replica, 0),
                                               min(pick.session_tokens, pick.prompt_tokens))
        uncached = {r.replica_id: max(0, pick.prompt_tokens - cached.get(r.replica_id, 0)) for r in routes}
        weight = {r.replica_id: pick.prompt_tokens + pick.expected_completion
                  + round(self.prefill_load * uncached[r.replica_id]) for r in routes}
        held = sum(r.held_tokens for r in routes)
        bound = (1 + self.max_load_excess) * (held + min(weight.values())) / len(routes)
        within = [r for r in routes if r.held_tokens + weight[r.replica_id] <= bound] or list(routes)
        cost = {r.replica_id: r.held_tokens + self.prefill_weight * uncached[r.replica_id] for r in within}
        cheapest = min(cost.values())
        tied = [r for r in within if cost[r.replica_id] == cheapest]
        fewest = min(r.in_flight for r in tied)
        chosen = self._ties.among([r for r in tied if r.in_flight == fewest])
        pick.prefix_tokens = matched.get(chosen.replica_id, 0)
        pick.held_weight = weight[chosen.replica_id]
        best = max(matched.values(), default=0)
        pick.prefix_spilled = best > pick.prefix_tokens   # a replica cached more of it, but was loaded
        return chosen

    def chosen(self, pick: Pick, route: Candidate) -> None:
        if pick.prefix_keys:
            self.index.record(route.replica_id, pick.prefix_keys)

    def forget(self, replica_ids: set[str]) -> None:
        for replica_id in replica_ids:
            self.index.forget(replica_id)
