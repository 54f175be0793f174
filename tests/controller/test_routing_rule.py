"""The routing rule (controller/routing.py): which replicas every balancer routes, and how a transition's
marks (take_out, bring_in) and the stale set change that - without a balancer process."""

from __future__ import annotations

import pytest

from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry
from controller.routing import Routing

pytestmark = pytest.mark.timeout(30)
S = ReplicaState


class Table:
    """One balancer's table as the reconciler writes it; ``fail`` makes the next writes raise."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.fail = False

    async def remove_replicas(self, ids, abort_in_flight: bool = False) -> None:
        if self.fail:
            raise ConnectionError("balancer down")
        self.ids.difference_update(ids)

    async def add_replicas(self, records) -> None:
        if self.fail:
            raise ConnectionError("balancer down")
        self.ids.update(r.replica_id for r in records)


def mesh(*specs: tuple[str, ReplicaKind, ReplicaState], version: int | None = None, hybrid_active: bool = False,
         owned: frozenset[str] = frozenset()) -> tuple[ReplicaRegistry, Table, Routing]:
    registry = ReplicaRegistry(clock=lambda: 0.0)
    registry.register_node("n", "127.0.0.1:1", slots_total=len(specs),
                           replicas=[ReplicaSpec(r, kind, state) for r, kind, state in specs])
    table = Table()
    routing = Routing(registry, table, weight_version=lambda: version, hybrid_active=lambda: hybrid_active,
                      owned=lambda record: record.replica_id in owned)
    return registry, table, routing


STANDALONE, HYBRID = ReplicaKind.STANDALONE, ReplicaKind.HYBRID


def test_the_rule_routes_serving_replicas_at_the_current_version_and_nothing_that_cannot_serve():
    registry, _, routing = mesh(("up", STANDALONE, S.ACTIVE), ("asleep", HYBRID, S.SLEEPING),
                                ("hybrid", HYBRID, S.ACTIVE), ("draining", STANDALONE, S.DRAINING),
                                ("owned", STANDALONE, S.ACTIVE), ("behind", STANDALONE, S.ACTIVE),
                                ("syncing", STANDALONE, S.SYNCING), version=2, owned=frozenset({"owned"}))
    for replica_id in ("up", "hybrid", "owned", "syncing"):
        registry.set_weight_version(replica_id, 2)
    # the hybrid replicas are not active: the hybrid one is not routed, though nothing forbids it either
    assert routing.wanted() == {"up"}
    assert {r for r in ("up", "asleep", "hybrid", "draining", "owned", "behind", "syncing", "unknown")
            if routing.must_not_route(r)} == {"asleep", "draining", "unknown"}


def test_without_a_weight_version_every_active_standalone_replica_is_routed_and_hybrids_follow_the_scheduler():
    _, _, routing = mesh(("a", STANDALONE, S.ACTIVE), ("h", HYBRID, S.ACTIVE), hybrid_active=True)
    assert routing.wanted() == {"a", "h"}


async def test_take_out_holds_a_replica_out_until_its_state_keeps_it_out_by_itself():
    registry, table, routing = mesh(("h", HYBRID, S.ACTIVE), hybrid_active=True)
    await routing.converge(["h"])
    assert table.ids == {"h"}
    await routing.take_out(["h"], why="released for training")
    assert table.ids == set() and routing.must_not_route("h") and routing.held == {"h": "released for training"}
    registry.transition("h", S.DRAINING, "draining")
    registry.transition("h", S.SLEEPING, "asleep")
    assert not routing.routes("h") and routing.held == {}   # asleep keeps it out: the hold is dropped


async def test_bring_in_routes_a_woken_replica_before_the_rule_would_and_the_mark_ends_once_the_rule_agrees():
    registry, table, routing = mesh(("h", HYBRID, S.PAUSED))
    await routing.bring_in(["h"])
    assert table.ids == {"h"} and routing.admitted == {"h"}
    registry.transition("h", S.ACTIVE, "resumed")
    # ACTIVE while the scheduler has not yet flagged the hybrid replicas active: the mark keeps it routed
    assert routing.routes("h") and routing.admitted == {"h"}
    routing.bind(weight_version=lambda: None, hybrid_active=lambda: True, owned=lambda record: False)
    assert routing.routes("h") and routing.admitted == set()


async def test_a_failed_write_leaves_the_marks_as_they_were():
    _, table, routing = mesh(("a", STANDALONE, S.ACTIVE))
    await routing.converge(["a"])
    table.fail = True
    with pytest.raises(ConnectionError):
        await routing.take_out(["a"], why="scale-in")
    assert routing.held == {} and routing.routes("a")
    with pytest.raises(ConnectionError):
        await routing.bring_in(["a"])
    assert routing.admitted == set()


async def test_a_stale_replica_stays_out_whatever_its_marks_until_a_sync_clears_it():
    _, table, routing = mesh(("a", STANDALONE, S.ACTIVE))
    routing.stale.add("a")
    await routing.bring_in(["a"])
    assert table.ids == set() and routing.must_not_route("a")
    routing.stale.discard("a")
    await routing.converge(["a"])
    assert table.ids == {"a"}


async def test_to_rule_ends_a_hold_whose_transition_did_not_finish():
    registry, table, routing = mesh(("a", STANDALONE, S.ACTIVE))
    await routing.converge(["a"])
    await routing.take_out(["a"], why="scale-in op-1")
    registry.transition("a", S.DRAINING, "scale-in op-1: draining")
    registry.transition("a", S.ACTIVE, "scale-in op-1 timed out; serving again")
    assert not routing.routes("a")   # still held: the scale-in has not said it is over
    await routing.to_rule(["a"])
    assert table.ids == {"a"} and routing.held == {}


async def test_a_reconcile_round_re_adds_what_a_balancer_lost_and_removes_what_it_must_not_route():
    class Balancer(Table):
        address = "127.0.0.1:9"

        async def routed(self):
            return {r: {} for r in self.ids}

    registry, _, _ = mesh(("a", STANDALONE, S.ACTIVE), ("b", STANDALONE, S.FAILED))
    balancer = Balancer()
    balancer.ids = {"b", "ghost"}

    class Tables:
        balancers = [balancer]

    routing = Routing(registry, Tables())   # type: ignore[arg-type]
    rounds: list[tuple[str, bool]] = []
    added, removed = await routing.reconcile(after_round=lambda address, ok: rounds.append((address, ok)))
    assert (added, removed) == (["a"], ["b", "ghost"]) and balancer.ids == {"a"}
    assert rounds == [("127.0.0.1:9", True)]
