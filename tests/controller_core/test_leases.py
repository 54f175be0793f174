"""The one lease abstraction (controller/core/leases.py) and the two registries that hold leases through it."""

from __future__ import annotations

import pytest

from controller.core.balancers import BalancerRegistry
from controller.core.errors import FailedPreconditionError, InvalidArgumentError
from controller.core.leases import Lease, Lessor
from controller.core.records import NodeRecord, ReplicaKind, ReplicaSpec, ReplicaState
from controller.core.replicas import ReplicaRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_is_held_until_its_expiry_passes_without_a_renewal_and_then_never_again():
    clock = Clock()
    lessor = Lessor(5.0, clock)
    lease = lessor.grant()
    assert lease == Lease(expires_at=105.0, held=True)
    clock.now = 104.0
    assert lessor.renew(lease, "node", "n1") == 109.0
    assert lessor.lapse([("n1", lease)], now=108.9) == []
    assert lessor.lapse([("n1", lease)], now=109.0) == ["n1"] and not lease.held
    assert lessor.lapse([("n1", lease)], now=200.0) == []   # a lapse is reported once
    with pytest.raises(FailedPreconditionError, match="register the node again"):
        lessor.renew(lease, "node", "n1")
    assert lease.expires_at == 109.0   # a refused renewal changes nothing


def test_a_restored_lease_gets_a_fresh_ttl_only_if_it_was_held():
    lessor = Lessor(5.0, Clock())
    held, lapsed, later = Lease(1.0, True), Lease(1.0, False), Lease(500.0, True)
    assert lessor.restore(held).expires_at == 105.0
    assert lessor.restore(lapsed).expires_at == 1.0
    assert lessor.restore(later).expires_at == 500.0


def test_a_ttl_must_be_positive():
    with pytest.raises(InvalidArgumentError, match="lease_ttl_s must be > 0"):
        Lessor(0.0, Clock())


def test_nodes_and_balancers_lapse_through_the_same_lessor_rules():
    clock = Clock()
    nodes = ReplicaRegistry(clock=clock, lease_ttl_s=5.0)
    nodes.register_node("n1", "127.0.0.1:1", slots_total=1,
                        replicas=[ReplicaSpec("r1", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
    balancers = BalancerRegistry(clock=clock, lease_ttl_s=5.0)
    balancers.register("lb-1", "127.0.0.1:2")
    clock.now = 105.0
    assert [r.replica_id for r in nodes.expire_leases()] == ["r1"]
    assert [m.balancer_id for m in balancers.expire()] == ["lb-1"]
    assert not nodes.node("n1").lease_held and balancers.members() == []


def test_a_node_document_keeps_its_flat_lease_fields():
    node = NodeRecord("n1", "127.0.0.1:1", lease=Lease(expires_at=42.0, held=False))
    document = node.to_document()
    assert (document.lease_expires_at, document.lease_held) == (42.0, False)
    assert NodeRecord.from_document(document) == node
    document.ClearField("lease_held")   # written before the flag: a lease is held
    assert NodeRecord.from_document(document).lease == Lease(expires_at=42.0, held=True)
