"""A broadcast that failed because one receiver died: the healthy replicas are synced again on their own."""

from __future__ import annotations

import grpc
import pytest
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import registry_pb2, scheduling_pb2, weight_sync_pb2

from trainer_agent.driver.loop import FullyAsyncLoop, task_prompts
from trainer_agent.driver.rollouter import GenerationResult, RolloutConfig, Segment
from trainer_agent.training import task
from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer
from trainer_agent.weight_source import TorchWeightSource

UNCHECKED = GrpoConfig(logprob_mismatch_bound=0)   # the fake generator's logprobs are made up, not the model's

pytestmark = pytest.mark.timeout(60)


class _Controller:
    """s-ok and s-dead were in one broadcast group; s-dead's agent is gone, its lease expires after 2 lists."""

    def __init__(self) -> None:
        self.sync_calls: list[list[str]] = []
        self.lists = 0

    async def BeginTrainingStep(self, request, timeout=None):  # noqa: N802
        return scheduling_pb2.BeginTrainingStepResponse()

    async def CompleteTrainingStep(self, request, timeout=None):  # noqa: N802
        result = weight_sync_pb2.WeightSyncResult(weight_version=request.weight_version, replica_results=[
            weight_sync_pb2.ReplicaSyncResult(replica_id=rid, ok=False, error_message="UNAVAILABLE: peer gone")
            for rid in ("s-ok", "s-dead")])
        return scheduling_pb2.CompleteTrainingStepResponse(standalone_sync=result)

    async def SyncWeights(self, request, timeout=None):  # noqa: N802
        self.sync_calls.append(list(request.replica_ids))
        ok = request.replica_ids == ["s-ok"]
        return weight_sync_pb2.SyncWeightsResponse(result=weight_sync_pb2.WeightSyncResult(
            weight_version=request.weight_version,
            replica_results=[weight_sync_pb2.ReplicaSyncResult(replica_id=request.replica_ids[0], ok=ok)]))

    async def ListReplicas(self, request, timeout=None):  # noqa: N802
        self.lists += 1
        dead = types_pb2.REPLICA_STATE_FAILED if self.lists >= 2 else types_pb2.REPLICA_STATE_ACTIVE
        return registry_pb2.ListReplicasResponse(replicas=[
            registry_pb2.ReplicaRecord(replica_id="s-ok", state=types_pb2.REPLICA_STATE_ACTIVE),
            # Nothing listens on port 9: the dead agent refuses connections.
            registry_pb2.ReplicaRecord(replica_id="s-dead", state=dead, address="127.0.0.1:9")])


async def _generate(request):
    return GenerationResult([Segment([task.DIGIT_IDS[2], task.EOS_ID], [-1.0, -1.0])])


async def _one() -> int:
    return 1


async def test_healthy_replicas_get_the_version_and_dead_ones_are_given_up():
    source = TorchWeightSource("tiny-llama", seed=1)
    source.load()
    controller = _Controller()
    loop = FullyAsyncLoop(controller, _generate, GrpoTrainer.from_weight_source(source, UNCHECKED),
                          RolloutConfig(n=2, ppo_mini_batch_size=1, trigger_parameter_sync_step=1, max_tokens=2),
                          task_prompts(task, 4, 1), task.reward, replica_count=_one, collect_timeout_s=10)
    [record] = await loop.run(1)
    assert record.resynced_replica_ids == ["s-ok"] and "s-ok" in record.synced_replica_ids
    assert "s-dead" not in record.synced_replica_ids
    # One replica per group; the agent that refuses connections is never synced (a broadcast to it would hang
    # until the rendezvous timed out) and is given up once its lease expired.
    assert controller.sync_calls == [["s-ok"]]
    assert controller.lists >= 2


class _LostBetweenListAndSync(_Controller):
    """s-lost is listed ACTIVE (its agent accepts connections) but is FAILED by the time SyncWeights runs."""

    async def ListReplicas(self, request, timeout=None):  # noqa: N802
        self.lists += 1
        return registry_pb2.ListReplicasResponse(replicas=[
            registry_pb2.ReplicaRecord(replica_id="s-ok", state=types_pb2.REPLICA_STATE_ACTIVE),
            registry_pb2.ReplicaRecord(replica_id="s-dead", state=types_pb2.REPLICA_STATE_ACTIVE)])

    async def SyncWeights(self, request, timeout=None):  # noqa: N802
        if request.replica_ids == ["s-dead"]:
            self.sync_calls.append(list(request.replica_ids))
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "only ACTIVE, PAUSED or SLEEPING replicas can receive weights: s-dead (FAILED)")
        return await super().SyncWeights(request, timeout)


async def test_a_replica_lost_between_listing_and_syncing_is_given_up_not_fatal():
    source = TorchWeightSource("tiny-llama", seed=1)
    source.load()
    controller = _LostBetweenListAndSync()
    loop = FullyAsyncLoop(controller, _generate, GrpoTrainer.from_weight_source(source, UNCHECKED),
                          RolloutConfig(n=2, ppo_mini_batch_size=1, trigger_parameter_sync_step=1, max_tokens=2),
                          task_prompts(task, 4, 1), task.reward, replica_count=_one, collect_timeout_s=10)
    [record] = await loop.run(1)
    assert record.resynced_replica_ids == ["s-ok"]
    assert sorted(map(tuple, controller.sync_calls)) == [("s-dead",), ("s-ok",)]
