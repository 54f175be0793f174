"""Resuming in a new mesh: replicas are brought to the checkpoint's version first; the checkpoint says what it holds."""

from __future__ import annotations

import pytest
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import registry_pb2, weight_sync_pb2

from trainer_agent.driver.checkpoint import checkpoint_info, save_checkpoint
from trainer_agent.driver.loop import FullyAsyncLoop, task_prompts
from trainer_agent.driver.rollouter import GenerationResult, RolloutConfig, Segment
from trainer_agent.training import task
from trainer_agent.training.grpo import GrpoTrainer
from trainer_agent.weight_source import TorchWeightSource

pytestmark = pytest.mark.timeout(60)

ACTIVE, SLEEPING, FAILED = (types_pb2.REPLICA_STATE_ACTIVE, types_pb2.REPLICA_STATE_SLEEPING,
                            types_pb2.REPLICA_STATE_FAILED)
STANDALONE, HYBRID = types_pb2.REPLICA_KIND_STANDALONE, types_pb2.REPLICA_KIND_HYBRID


class _Controller:
    """A fresh mesh: every replica at version 0; ``flaky`` fails in the group broadcast, ``broken`` always."""

    def __init__(self, *, flaky: str = "", broken: str = "") -> None:
        self.versions = {"s-a": 0, "s-b": 0, "h0": 0, "s-gone": 0}
        self.kinds = {"s-a": STANDALONE, "s-b": STANDALONE, "h0": HYBRID, "s-gone": STANDALONE}
        self.states = {"s-a": ACTIVE, "s-b": ACTIVE, "h0": SLEEPING, "s-gone": FAILED}
        self.flaky, self.broken = flaky, broken
        self.sync_calls: list[tuple[list[str], int]] = []

    async def ListReplicas(self, request, timeout=None):  # noqa: N802
        return registry_pb2.ListReplicasResponse(replicas=[
            registry_pb2.ReplicaRecord(replica_id=rid, kind=self.kinds[rid], state=self.states[rid],
                                       weight_version=self.versions[rid]) for rid in self.versions])

    async def SyncWeights(self, request, timeout=None):  # noqa: N802
        ids = list(request.replica_ids)
        self.sync_calls.append((ids, request.weight_version))
        results = []
        for rid in ids:
            ok = rid != self.broken and not (rid == self.flaky and len(ids) > 1)
            if ok:
                self.versions[rid] = request.weight_version
            results.append(weight_sync_pb2.ReplicaSyncResult(replica_id=rid, ok=ok))
        return weight_sync_pb2.SyncWeightsResponse(result=weight_sync_pb2.WeightSyncResult(
            weight_version=request.weight_version, replica_results=results))


async def _generate(request):
    return GenerationResult([Segment([task.DIGIT_IDS[2], task.EOS_ID], [-1.0, -1.0])])


async def _one() -> int:
    return 1


def _loop(controller) -> FullyAsyncLoop:
    source = TorchWeightSource("tiny-llama", seed=1)
    source.load()
    return FullyAsyncLoop(controller, _generate, GrpoTrainer.from_weight_source(source),
                          RolloutConfig(n=2, ppo_mini_batch_size=1, trigger_parameter_sync_step=1, max_tokens=2),
                          task_prompts(task, 4, 1), task.reward, replica_count=_one, replica_poll_s=0.01,
                          collect_timeout_s=10)


async def test_every_live_replica_behind_is_synced_in_one_call_and_failed_standalones_one_by_one():
    controller = _Controller(flaky="s-b")
    versions = await _loop(controller).bring_replicas_to(7)
    # the FAILED replica is left out; the sleeping hybrid one comes along; s-b's failed part is redone alone
    assert controller.sync_calls == [(["s-a", "s-b", "h0"], 7), (["s-b"], 7)]
    assert versions == {"s-a": 7, "s-b": 7, "h0": 7, "s-gone": 0}


async def test_replicas_already_at_the_version_are_not_synced_again():
    controller = _Controller()
    controller.versions.update({"s-a": 3, "s-b": 3, "h0": 3})
    assert await _loop(controller).bring_replicas_to(3) == {"s-a": 3, "s-b": 3, "h0": 3, "s-gone": 0}
    assert controller.sync_calls == []


async def test_a_standalone_replica_that_cannot_get_the_version_fails_the_resume(monkeypatch):
    controller = _Controller(broken="s-b")
    loop = _loop(controller)
    loop._sync_timeout = 0.3  # the one-by-one retries give up after this long
    with pytest.raises(RuntimeError, match=r"s-b \(version 0\).*weight version 5"):
        await loop.bring_replicas_to(5)
    assert controller.versions["s-a"] == 5


def test_checkpoint_info_reads_the_step_the_counters_and_the_job(tmp_path):
    assert checkpoint_info(tmp_path) is None
    driver = {"version": 1, "next_step": 4, "queue": {"samples": [{"x": 1}] * 3, "generated": 30, "consumed": 24,
                                                      "dropped": 3},
              "rollouter": {"pending": [{"group_id": "p1#9"}]}}
    save_checkpoint(tmp_path, trainer_state={"weight_version": 3, "params": {}, "optimizer": {}},
                    driver_state=driver, records=[], job={"model": "tiny-llama", "rollout_n": 8})
    info = checkpoint_info(tmp_path)
    assert (info.global_step, info.weight_version, info.queue_size, info.pending_groups) == (3, 3, 3, 1)
    assert (info.generated, info.consumed, info.dropped) == (30, 24, 3)
    assert info.job == {"model": "tiny-llama", "rollout_n": 8}


def test_an_unreadable_checkpoint_is_named(tmp_path):
    (tmp_path / "driver.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        checkpoint_info(tmp_path)
