"""Replicas more than one version behind catch up by one delta when the trainer still has the way there.

The trainer keeps the deltas of its last versions (``weight_transfer.delta_history``) and composes them into
one delta from an older version on request. A sync sends the replicas at the base version their delta first;
then the replicas behind it, grouped by the version they hold, newest first, each group take a delta from
their version where the trainer offers one (one more broadcast per group: a few bytes each, against a full
copy). What no delta reaches gets a full copy (:mod:`controller.weight_sync`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from .core.ports import WeightSyncOutcome


async def catch_up(behind: Sequence[str], held: Callable[[str], int], offers: Callable[[int], Awaitable[bool]],
                   broadcast: Callable[[list[str], int], Awaitable[tuple[WeightSyncOutcome, str]]],
                   ) -> tuple[list[WeightSyncOutcome], list[str]]:
    """Deltas for ``behind`` (``held(replica)``: the version it holds; ``offers(base)``: whether the trainer
    sends a delta from ``base``; ``broadcast(replicas, base)``: send it, with why it could not start). Returns
    the broadcasts' outcomes and the replicas that still need a full copy: those at no offered version, those
    a delta's broadcast could not start for, and those that turned out not to hold its base."""
    groups: dict[int, list[str]] = {}
    for replica_id in behind:
        groups.setdefault(held(replica_id), []).append(replica_id)
    outcomes: list[WeightSyncOutcome] = []
    rest: list[str] = []
    for base in sorted(groups, reverse=True):
        group = groups[base]
        if base <= 0 or not await offers(base):
            rest += group
            continue
        outcome, why = await broadcast(group, base)
        if why:
            rest += group
            continue
        outcomes.append(outcome)
        rest += [r.replica_id for r in outcome.replica_results if r.delta_base_missing]
    return outcomes, rest
