"""``CheckpointFlip`` (the controller's LoadWeights) over scripted agents: every node checks before any replica
changes; a replica that fails is excluded (stale, out of routing) and the version commits on the rest, or with
rollback every replica that installed goes back and nothing is pushed; a replica that cannot go back leaves
routing; a checkpoint no replica can load changes nothing."""

from __future__ import annotations

import types

import pytest

from controller.checkpoint_load import CheckpointFlip
from mesh_runtime.errors import FailedPrecondition
from rollmesh.replica.v1 import replica_agent_pb2 as pb

STEP = pb.CheckpointStep.Name


class _Agents:
    """Two nodes (n1: r1, r2; n2: r3); ``fail[(step, replica)]`` is that replica's error in that step."""

    def __init__(self, fail: dict[tuple[str, str], str]) -> None:
        self.fail = fail
        self.calls: list[tuple[str, str, tuple[str, ...], bool]] = []
        self.address = {"r1": "n1", "r2": "n1", "r3": "n2"}

    def agent(self, address: str):
        async def load_checkpoint(request: pb.LoadCheckpointRequest, timeout: float) -> pb.LoadCheckpointResponse:
            step = STEP(request.step).removeprefix("CHECKPOINT_STEP_")
            self.calls.append((step, address, tuple(request.replica_ids), request.keep_previous))
            out = pb.LoadCheckpointResponse()
            for r in request.replica_ids:
                why = self.fail.get((step, r), "")
                out.results.add(replica_id=r, checksum_ok=not why, error_message=why,
                                weight_version=request.weight_version if step == "INSTALL" and not why else 0)
            return out
        return types.SimpleNamespace(LoadCheckpoint=load_checkpoint)

    def get(self, replica_id: str):
        return types.SimpleNamespace(address=self.address[replica_id])


async def _flip(fail: dict, *, rollback: bool):
    agents = _Agents(fail)
    pushed: list[tuple[dict[str, bool], int]] = []

    async def push(results, version):
        pushed.append(({r.replica_id: r.ok for r in results}, version))
    flip = await CheckpointFlip(agents, agents, push).load(["r1", "r2", "r3"], "/ckpt", 4, rollback=rollback,
                                                           timeout_s=5)
    return flip, agents.calls, pushed


def _oks(flip) -> dict[str, bool]:
    return {r.replica_id: r.ok for r in flip.outcome.replica_results}


async def test_all_load_then_the_versions_flip_together():
    flip, calls, pushed = await _flip({}, rollback=False)
    assert flip.committed and not flip.rolled_back and _oks(flip) == {"r1": True, "r2": True, "r3": True}
    assert [c[0] for c in calls] == ["CHECK", "CHECK", "INSTALL", "INSTALL"]     # one call per node and step
    assert pushed == [({"r1": True, "r2": True, "r3": True}, 4)]
    assert flip.outcome.source == "checkpoint" and flip.outcome.weight_version == 4


async def test_exclude_commits_on_the_rest_and_takes_the_failed_out_of_routing():
    flip, calls, pushed = await _flip({("CHECK", "r2"): "r2 has another model", ("INSTALL", "r3"): "disk error"},
                                      rollback=False)
    assert flip.committed and _oks(flip) == {"r1": True, "r2": False, "r3": False}
    assert ("INSTALL", "n1", ("r1",), False) in calls                          # r2 never installs
    assert pushed == [({"r1": True, "r2": False, "r3": False}, 4)]             # failed ones go stale
    assert dict((r.replica_id, r.error_message) for r in flip.outcome.replica_results)["r2"] == "r2 has another model"


async def test_rollback_after_a_failed_check_installs_nothing():
    flip, calls, pushed = await _flip({("CHECK", "r3"): "missing tensor"}, rollback=True)
    assert flip.rolled_back and not flip.committed and not any(_oks(flip).values())
    assert [c[0] for c in calls] == ["CHECK", "CHECK"] and all(c[3] for c in calls) and pushed == []
    assert "rolled back: 1 replica(s) could not load the checkpoint (r3: missing tensor)" in \
        flip.outcome.replica_results[0].error_message


async def test_rollback_after_a_failed_install_reverts_the_others_and_pushes_nothing():
    flip, calls, pushed = await _flip({("INSTALL", "r3"): "disk error"}, rollback=True)
    assert flip.rolled_back and not flip.committed and not any(_oks(flip).values())
    assert ("REVERT", "n1", ("r1", "r2"), True) in calls and pushed == []
    assert not any(c[0] == "RELEASE" for c in calls)


async def test_a_replica_that_cannot_go_back_leaves_routing():
    flip, calls, pushed = await _flip({("INSTALL", "r3"): "disk error", ("REVERT", "r2"): "engine died"},
                                      rollback=True)
    assert flip.rolled_back and pushed == [({"r2": False}, 4)]
    why = {r.replica_id: r.error_message for r in flip.outcome.replica_results}
    assert "could not go back: engine died" in why["r2"] and why["r3"] == "disk error"


async def test_a_committed_rollback_flip_releases_the_kept_weights():
    flip, calls, pushed = await _flip({}, rollback=True)
    assert flip.committed and [c[0] for c in calls][-2:] == ["RELEASE", "RELEASE"]
    assert pushed == [({"r1": True, "r2": True, "r3": True}, 4)]


async def test_a_checkpoint_no_replica_can_load_changes_nothing():
    fail = {("CHECK", r): "not a directory" for r in ("r1", "r2", "r3")}
    for rollback in (False, True):
        with pytest.raises(FailedPrecondition, match="no replica can load checkpoint /ckpt: not a directory"):
            await _flip(fail, rollback=rollback)
