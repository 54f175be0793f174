"""One lock for every transition: the scheduler's step calls, scale operations and routing reconciliation share
``Mesh.transitions``, and reconciliation waits its turn instead of being skipped while the lock is busy."""

from __future__ import annotations

import asyncio

import pytest

from controller.config import ControllerConfig
from controller.core.steps import StepReport
from controller.mesh import Mesh
from mesh_runtime.config import load_config

pytestmark = pytest.mark.timeout(30)


async def settle(rounds: int = 20) -> None:
    """Let every task that can run, run (no wall-clock wait)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


@pytest.fixture
async def mesh(tmp_path):
    mesh = Mesh(load_config(ControllerConfig, None, overrides={"state_dir": str(tmp_path / "state")}), None)
    yield mesh
    await mesh.close()


async def test_a_step_call_waits_for_a_scale_operation_holding_the_lock(mesh):
    assert mesh.scheduler._lock is mesh.transitions   # one lock, not one per component
    async with mesh.transitions:                        # what a scale operation holds while it routes
        begin = asyncio.create_task(mesh.begin_step(1, StepReport()))
        await settle()
        assert not begin.done()
    decision = await asyncio.wait_for(begin, 5)
    assert mesh.scheduler.current_step == 1 and decision is not None


async def test_reconciliation_takes_its_turn_on_a_busy_lock(mesh, monkeypatch):
    order: list[str] = []

    class Balancer:
        address = "lb:1"

        async def routed(self):
            order.append("reconcile")
            return {}   # an empty table, as the empty registry wants: the round ends after reading it

    monkeypatch.setattr(mesh.routing.tables, "configured", [Balancer()])

    async def step_call(name: str) -> None:
        async with mesh.transitions:
            order.append(name)

    async with mesh.transitions:   # a step call is running
        reconcile = asyncio.create_task(mesh.reconcile_routing())
        await settle()
        later = asyncio.create_task(step_call("next step call"))   # asks after reconciliation did
        await settle()
        assert order == []
    assert await asyncio.wait_for(reconcile, 5) == ([], [])
    await asyncio.wait_for(later, 5)
    assert order == ["reconcile", "next step call"]   # fair: served in the order asked, none skipped
