"""The controller's poll of external nodes survives a node forgotten mid-poll and a slow node."""

from __future__ import annotations

import asyncio
import types

import pytest

from controller.core.records import ReplicaKind, ReplicaSpec, ReplicaState

from controller.core.replicas import ReplicaRegistry
from controller.scaling.scaler import Scaler
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def external_registry(clock: Clock) -> ReplicaRegistry:
    registry = ReplicaRegistry(clock=clock, lease_ttl_s=3.0)
    for node in ("e1", "e2"):
        registry.register_node(node, f"{node}:1", slots_total=1,
                               replicas=[ReplicaSpec(f"{node}-s0", ReplicaKind.STANDALONE, ReplicaState.ACTIVE)])
        next(n for n in registry.nodes() if n.node_id == node).external = True
    return registry


async def test_a_node_forgotten_while_polled_does_not_stop_the_others_renewals():
    clock = Clock()
    registry = external_registry(clock)
    e1_polled, release_e1 = asyncio.Event(), asyncio.Event()

    async def load_reports(address):
        if address == "e1:1":
            e1_polled.set()
            await release_e1.wait()  # e1 is slow; meanwhile it is rolled back
        return []

    scaler = types.SimpleNamespace(calls=types.SimpleNamespace(load_reports=load_reports), registry=registry,
                                   renew=lambda node_id, reports: registry.renew(node_id),
                                   config=types.SimpleNamespace(load_report_interval_s=0.01))
    scaler._poll_external = lambda node_id, address: Scaler._poll_external(scaler, node_id, address)
    loop = asyncio.create_task(Scaler.hold_external_leases(scaler))
    try:
        await e1_polled.wait()
        registry.forget_node("e1", "rolled back")
        clock.now += 2.0
        release_e1.set()  # its answer arrives for a node that is gone
        e2 = next(n for n in registry.nodes() if n.node_id == "e2")
        before = e2.lease_expires_at
        clock.now += 2.0
        # the loop survives e1's late answer and keeps renewing e2
        await wait_until(lambda: e2.lease_expires_at > before or loop.done(), 5, what="e2's lease to be renewed")
        assert not loop.done(), loop.exception() if loop.done() else None
        assert e2.lease_expires_at == pytest.approx(clock.now + 3.0)
    finally:
        loop.cancel()
