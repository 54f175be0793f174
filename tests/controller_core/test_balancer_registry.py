"""The registered balancers' membership: leases, moves, restarts, readiness and what survives a takeover."""

from __future__ import annotations

import pytest

from controller.core.balancers import BalancerRegistry
from controller.core.errors import AlreadyExistsError, NotFoundError
from controller.core.events import EventType


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, events: list) -> BalancerRegistry:
    return BalancerRegistry(clock=clock, emit=lambda type, **fields: events.append((type, fields)), lease_ttl_s=4.0)


def test_registering_is_the_heartbeat_and_a_lapsed_lease_drops_the_balancer():
    clock, events = Clock(), []
    reg = make(clock, events)
    member, changed, fresh = reg.register("lb-a", "10.0.0.1:7000", "1.0", "run1")
    assert (changed, fresh) == (True, True) and member.lease_expires_at == 1004.0
    clock.now += 3
    member, changed, fresh = reg.register("lb-a", "10.0.0.1:7000", "1.0", "run1")   # renewal: no change
    assert (changed, fresh) == (False, False) and member.lease_expires_at == 1007.0
    assert [t for t, _ in events] == [EventType.BALANCER_REGISTERED]
    clock.now += 3.9
    assert reg.expire() == [] and reg.addresses() == ["10.0.0.1:7000"]
    clock.now += 0.2
    assert [m.balancer_id for m in reg.expire()] == ["lb-a"]
    assert reg.addresses() == []
    assert events[-1][0] is EventType.BALANCER_LEASE_EXPIRED
    assert events[-1][1]["attributes"] == {"balancer_id": "lb-a", "address": "10.0.0.1:7000"}


def test_a_restarted_balancer_is_not_ready_until_its_table_is_filled_again():
    clock, events = Clock(), []
    reg = make(clock, events)
    reg.register("lb-a", "10.0.0.1:7000", "", "run1")
    assert reg.set_ready("10.0.0.1:7000", True) and "10.0.0.1:7000" in reg.ready
    assert not reg.set_ready("10.0.0.1:7000", True)   # no change, nothing to write
    _, changed, fresh = reg.register("lb-a", "10.0.0.1:7000", "", "run2")   # same id and address, new process
    assert (changed, fresh) == (False, True) and "10.0.0.1:7000" not in reg.ready
    assert len(events) == 1   # a restart is not a membership change


def test_a_balancer_that_moves_keeps_its_id_and_addresses_are_unique():
    clock, events = Clock(), []
    reg = make(clock, events)
    reg.register("lb-a", "10.0.0.1:7000", "", "run1")
    reg.set_ready("10.0.0.1:7000", True)
    _, changed, _ = reg.register("lb-a", "10.0.0.2:7000", "", "run2")
    assert changed and reg.addresses() == ["10.0.0.2:7000"] and reg.ready == set()
    with pytest.raises(AlreadyExistsError) as err:
        reg.register("lb-b", "10.0.0.2:7000", "", "x")
    assert err.value.reason == "BALANCER_ADDRESS_TAKEN" and err.value.metadata == {"balancer_id": "lb-a"}
    assert reg.addresses() == ["10.0.0.2:7000"]   # the refused call changed nothing


def test_deregistering_removes_at_once_and_an_unknown_id_is_not_found():
    clock, events = Clock(), []
    reg = make(clock, events)
    reg.register("lb-a", "10.0.0.1:7000", "", "r")
    reg.set_ready("10.0.0.1:7000", True)
    reg.deregister("lb-a", "balancer shutdown")
    assert reg.addresses() == [] and reg.ready == set()
    assert events[-1][0] is EventType.BALANCER_DEREGISTERED and events[-1][1]["reason"] == "balancer shutdown"
    with pytest.raises(NotFoundError) as err:
        reg.deregister("lb-a")
    assert err.value.reason == "BALANCER_NOT_FOUND"


def test_membership_and_readiness_survive_a_takeover_with_fresh_leases():
    clock, events = Clock(), []
    reg = make(clock, events)
    reg.register("lb-a", "10.0.0.1:7000", "1.0", "r")
    reg.register("lb-b", "10.0.0.2:7000", "1.0", "r")
    reg.set_ready("10.0.0.1:7000", True)
    saved = reg.to_document()
    clock.now += 100   # the leases lapsed while no controller acted
    restored = make(clock, [])
    restored.restore(saved)
    assert restored.addresses() == ["10.0.0.1:7000", "10.0.0.2:7000"]
    assert restored.ready == {"10.0.0.1:7000"}
    assert all(m.lease_expires_at == clock.now + 4.0 for m in restored.members())
    assert restored.expire() == []
