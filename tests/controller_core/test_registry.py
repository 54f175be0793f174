"""Replica registry: transition table, leases, registration, counting, persistence, stateful test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from controller.core import (
    EventLog,
    EventType,
    FailedPreconditionError,
    InvalidTransition,
    NotFoundError,
    ReplicaKind,
    ReplicaRegistry,
    ReplicaSpec,
    ReplicaState,
)
from controller.core.records import ALLOWED_TRANSITIONS, TERMINAL_STATES

from .fakes import FakeClock

pytestmark = pytest.mark.timeout(60)

S, K = ReplicaState, ReplicaKind


def make(ttl: float = 10.0):
    clock = FakeClock(100.0)
    log = EventLog(clock)
    return ReplicaRegistry(clock=clock, emit=log.append, lease_ttl_s=ttl), log, clock


def test_transition_table_and_events():
    reg, log, _ = make()
    reg.register_node("n1", "h:1", replicas=[ReplicaSpec("r1", K.HYBRID, S.ACTIVE)])
    reg.transition("r1", S.DRAINING, "removed from routing", global_step=7)
    event = log.since(0)[0][-1]
    assert (event.type, event.from_state, event.to_state, event.replica_kind, event.global_step) == (
        EventType.REPLICA_STATE_CHANGED, "REPLICA_STATE_ACTIVE", "REPLICA_STATE_DRAINING",
        "REPLICA_KIND_HYBRID", 7)
    with pytest.raises(InvalidTransition, match="REPLICA_STATE_DRAINING to REPLICA_STATE_PAUSED"):
        reg.transition("r1", S.PAUSED, "no")
    assert reg.get("r1").state is S.DRAINING
    before = log.last_sequence
    reg.transition("r1", S.DRAINING, "again")          # same state: no-op, no event
    assert log.last_sequence == before
    # sleeping replicas must be woken (PAUSED) before they serve; active ones must drain before sleeping
    assert S.ACTIVE not in ALLOWED_TRANSITIONS[S.SLEEPING]
    assert S.SLEEPING not in ALLOWED_TRANSITIONS[S.ACTIVE]
    assert ALLOWED_TRANSITIONS[S.REMOVED] == frozenset()


def test_counts_hybrid_as_hybrid_once():
    reg, _, _ = make()
    reg.register_node("s", "h:1", replicas=[ReplicaSpec("s1", K.STANDALONE, S.ACTIVE),
                                            ReplicaSpec("s2", K.STANDALONE, S.SLEEPING)])
    reg.register_node("t", "h:2", replicas=[ReplicaSpec("h1", K.HYBRID, S.ACTIVE),
                                            ReplicaSpec("h2", K.HYBRID, S.ACTIVE)])
    assert reg.active_count(K.STANDALONE) == 1
    assert reg.active_count(K.HYBRID) == 2
    assert reg.get_active_server_count() == 3 == reg.active_count()
    assert reg.counts()["HYBRID"]["ACTIVE"] == 2 and reg.counts()["STANDALONE"]["ACTIVE"] == 1


def test_leases_expire_and_require_re_registration():
    reg, log, clock = make(ttl=5)
    reg.register_node("n1", "h:1", replicas=[ReplicaSpec("r1", K.STANDALONE, S.ACTIVE),
                                             ReplicaSpec("r2", K.STANDALONE, S.STOPPED)])
    clock.advance(4)
    assert reg.renew("n1") == 109
    assert reg.expire_leases(108.9) == []
    failed = reg.expire_leases(109)
    assert [r.replica_id for r in failed] == ["r1"]
    assert reg.get("r1").state is S.FAILED and reg.get("r1").state_reason == "lease expired"
    assert reg.get("r2").state is S.STOPPED
    assert any(e.type is EventType.LEASE_EXPIRED for e in log.since(0)[0])
    assert reg.expire_leases(200) == []               # reported once
    with pytest.raises(FailedPreconditionError, match="register the node again"):
        reg.renew("n1")
    result = reg.register_node("n1", "h:1", replicas=[ReplicaSpec("r1", K.STANDALONE, S.ACTIVE)])
    assert result.accepted == ("r1",) and reg.get("r1").state is S.ACTIVE
    assert reg.renew("n1", now=clock() + 1) == clock() + 6


def test_registration_replaces_and_rejects_intentionally_removed():
    reg, _, _ = make()
    reg.register_node("n1", "h:1", replicas=[ReplicaSpec("a", K.STANDALONE, S.ACTIVE),
                                             ReplicaSpec("b", K.STANDALONE, S.ACTIVE),
                                             ReplicaSpec("c", K.STANDALONE, S.ACTIVE)])
    reg.transition("c", S.DRAINING, "scale-in op-1")
    reg.transition("c", S.STOPPED, "scale-in op-1")
    reg.mark_removed("c", "scale-in op-1", operation_id="op-1")
    result = reg.register_node("n1", "h:9", replicas=[ReplicaSpec("a", K.STANDALONE, S.SLEEPING),
                                                      ReplicaSpec("c", K.STANDALONE, S.ACTIVE)])
    assert result.accepted == ("a",) and "removed on purpose" in result.rejected["c"]
    assert reg.get("a").state is S.SLEEPING and reg.get("a").address == "h:9"
    assert reg.get("b").state is S.FAILED and "missing" in reg.get("b").state_reason
    assert reg.get("c").state is S.REMOVED and reg.get("c").intentionally_removed
    assert reg.node("n1").address == "h:9"


def test_deregister_stops_replicas_and_unknown_ids_are_not_found():
    reg, _, _ = make()
    reg.register_node("n1", "h:1", replicas=[ReplicaSpec("a", K.HYBRID, S.SLEEPING)])
    assert reg.deregister_node("n1", "agent shutdown") == ["a"]
    assert reg.get("a").state is S.STOPPED
    with pytest.raises(NotFoundError, match="node 'n1'"):
        reg.node("n1")
    with pytest.raises(NotFoundError, match="replica 'zz'"):
        reg.transition("zz", S.ACTIVE)


def test_document_round_trip_gives_fresh_leases():
    reg, _, clock = make(ttl=5)
    reg.register_node("n1", "h:1", replicas=[ReplicaSpec("a", K.HYBRID, S.SLEEPING, weight_version=3,
                                                         slots=(0, 1), initial=True)])
    reg.record_report("a", object())
    data = reg.documents()
    clock.advance(1000)
    restored = ReplicaRegistry.from_documents(data, clock=clock, lease_ttl_s=5)
    assert restored.get("a").weight_version == 3 and restored.get("a").slots == (0, 1)
    assert restored.get("a").last_report is None
    assert restored.node("n1").lease_expires_at == clock() + 5
    assert restored.expire_leases() == []
    [again] = restored.documents()
    assert again.replicas[0].lease_expires_at == clock() + 5
    again.replicas[0].lease_expires_at = data[0].replicas[0].lease_expires_at
    assert list(again.replicas) == list(data[0].replicas)


# --- stateful property test ---

NODES = ["n1", "n2", "n3"]
IDS = {f"{node}-{i}": (node, K.HYBRID if i % 2 else K.STANDALONE) for node in NODES for i in range(3)}
REGISTRABLE = [s for s in ReplicaState if s is not S.REMOVED]


class RegistryMachine(RuleBasedStateMachine):
    replica_ids = Bundle("replica_ids")

    @initialize()
    def setup(self):
        self.clock = FakeClock(0.0)
        self.log = EventLog(self.clock, max_events=100_000)
        self.reg = ReplicaRegistry(clock=self.clock, emit=self.log.append, lease_ttl_s=10)
        self.known: set[str] = set()
        self.removed: set[str] = set()

    @rule(target=replica_ids, node=st.sampled_from(NODES),
          picks=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(REGISTRABLE)), max_size=3,
                         unique_by=lambda p: p[0]))
    def register(self, node, picks):
        specs = [ReplicaSpec(f"{node}-{i}", IDS[f"{node}-{i}"][1], state) for i, state in picks]
        result = self.reg.register_node(node, f"{node}:1", replicas=specs)
        for rid in result.accepted:
            self.known.add(rid)
            assert rid not in self.removed
        for rid in result.rejected:
            assert rid in self.removed
        return specs[0].replica_id if specs else "n1-0"

    @rule(rid=replica_ids, to=st.sampled_from(list(ReplicaState)))
    def transition(self, rid, to):
        if rid not in self.reg:
            return
        before = self.reg.get(rid).state
        try:
            self.reg.transition(rid, to, "random move")
        except InvalidTransition:
            assert to not in ALLOWED_TRANSITIONS[before] and to is not before
            assert self.reg.get(rid).state is before
        else:
            assert to is before or to in ALLOWED_TRANSITIONS[before]
            assert self.reg.get(rid).state is to

    @rule(rid=replica_ids)
    def remove_on_purpose(self, rid):
        if rid in self.reg and self.reg.can_transition(rid, S.REMOVED):
            self.reg.mark_removed(rid, "scale-in")
            self.removed.add(rid)

    @rule(node=st.sampled_from(NODES))
    def renew(self, node):
        try:
            self.reg.renew(node)
        except (NotFoundError, FailedPreconditionError):
            pass

    @rule(dt=st.floats(0, 15))
    def time_passes_and_leases_expire(self, dt):
        self.clock.advance(dt)
        for record in self.reg.expire_leases():
            assert record.state is S.FAILED and record.state_reason == "lease expired"

    @rule(node=st.sampled_from(NODES))
    def deregister(self, node):
        try:
            for rid in self.reg.deregister_node(node, "shutdown"):
                assert self.reg.get(rid).state is S.STOPPED
        except NotFoundError:
            pass

    @invariant()
    def no_replica_lost_and_states_valid(self):
        if not hasattr(self, "reg"):
            return
        present = {r.replica_id for r in self.reg.replicas()}
        assert self.known <= present
        for record in self.reg.replicas():
            assert isinstance(record.state, ReplicaState)
            assert record.kind is IDS[record.replica_id][1]
        for rid in self.removed:
            assert self.reg.get(rid).state is S.REMOVED and self.reg.get(rid).intentionally_removed

    @invariant()
    def counts_consistent(self):
        if not hasattr(self, "reg"):
            return
        records = self.reg.replicas()
        hybrid = sum(1 for r in records if r.kind is K.HYBRID and r.state is S.ACTIVE)
        standalone = sum(1 for r in records if r.kind is K.STANDALONE and r.state is S.ACTIVE)
        assert self.reg.active_count(K.HYBRID) == hybrid
        assert self.reg.active_count(K.STANDALONE) == standalone
        assert self.reg.get_active_server_count() == hybrid + standalone
        assert sum(self.reg.counts()["HYBRID"].values()) == sum(1 for r in records if r.kind is K.HYBRID)

    @invariant()
    def every_transition_event_is_allowed(self):
        if not hasattr(self, "log"):
            return
        for event in self.log.since(0)[0]:
            recorded_from_agent = event.reason in ("registered", "reported by agent on registration")
            if event.type is EventType.REPLICA_STATE_CHANGED and event.from_state and not recorded_from_agent:
                src = ReplicaState(event.from_state.removeprefix("REPLICA_STATE_"))
                dst = ReplicaState(event.to_state.removeprefix("REPLICA_STATE_"))
                assert dst in ALLOWED_TRANSITIONS[src], event

    @invariant()
    def persistence_round_trip(self):
        if not hasattr(self, "reg"):
            return
        restored = ReplicaRegistry.from_documents(self.reg.documents(), clock=self.clock)
        assert [(r.replica_id, r.state, r.kind, r.intentionally_removed) for r in restored.replicas()] == \
               [(r.replica_id, r.state, r.kind, r.intentionally_removed) for r in self.reg.replicas()]


RegistryMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRegistryMachine = RegistryMachine.TestCase


def test_terminal_states_hold_no_engine():
    assert TERMINAL_STATES == {S.FAILED, S.STOPPED, S.REMOVED}


class _CountingDict(dict):
    """A dict that counts how many of its values are looked at (the registry's replica table)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookups = 0

    def __getitem__(self, key):
        self.lookups += 1
        return super().__getitem__(key)

    def __iter__(self):
        self.lookups += len(self)
        return super().__iter__()


def test_a_lease_renewal_touches_only_the_nodes_replicas():
    # the fleet-scale issue: a renewal filtered and sorted every replica of the fleet (quadratic overall)
    registry = ReplicaRegistry(clock=lambda: 0.0, lease_ttl_s=30)
    for n in range(500):
        registry.register_node(f"n{n}", f"h{n}:1", replicas=[
            ReplicaSpec(f"n{n}-r{i}", ReplicaKind.STANDALONE, ReplicaState.ACTIVE) for i in range(8)])
    registry._replicas = _CountingDict(registry._replicas)
    registry.renew("n250")
    assert registry._replicas.lookups <= 8
    assert [r.replica_id for r in registry.replicas(node_id="n7")] == [f"n7-r{i}" for i in range(8)]
    assert registry._replicas.lookups <= 16


def test_the_node_index_follows_moves_forgets_and_restores():
    registry = ReplicaRegistry(clock=lambda: 0.0, lease_ttl_s=30)
    registry.register_node("a", "a:1", replicas=[ReplicaSpec("r1", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    registry.register_node("b", "b:1")
    registry.transition("r1", ReplicaState.FAILED, "test")
    registry.register_node("b", "b:1", replicas=[ReplicaSpec("r1", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    assert [r.replica_id for r in registry.replicas(node_id="b")] == ["r1"]
    assert registry.replicas(node_id="a") == []                      # moved, not listed twice
    registry.forget_node("b", "rolled back")
    assert registry.replicas(node_id="b") == [] and "r1" not in registry
    registry.register_node("c", "c:1", replicas=[ReplicaSpec("r2", ReplicaKind.HYBRID, ReplicaState.SLEEPING)])
    restored = ReplicaRegistry.from_documents(registry.documents(), clock=lambda: 0.0)
    assert [r.replica_id for r in restored.replicas(node_id="c")] == ["r2"]


def test_changes_name_only_the_nodes_that_changed_and_a_forgotten_node_is_deleted():
    registry = ReplicaRegistry(clock=lambda: 0.0, lease_ttl_s=30)
    for n in range(3):
        registry.register_node(f"n{n}", f"h{n}:1", replicas=[
            ReplicaSpec(f"n{n}-r0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    assert [node for node, _ in registry.take_changes()] == ["n0", "n1", "n2"]
    registry.renew("n1")
    assert registry.take_changes() == []                                # a renewal is not durable
    registry.transition("n2-r0", ReplicaState.FAILED, "test")
    registry.set_weight_version("n0-r0", 4)
    changes = dict(registry.take_changes())
    assert sorted(changes) == ["n0", "n2"] and changes["n0"].replicas[0].weight_version == 4
    registry.forget_node("n1", "rolled back")
    assert registry.take_changes() == [("n1", None)]
    restored = ReplicaRegistry.from_documents([changes["n0"], changes["n2"]], clock=lambda: 0.0, lease_ttl_s=30)
    assert [r.replica_id for r in restored.replicas()] == ["n0-r0", "n2-r0"] and restored.take_changes() == []
