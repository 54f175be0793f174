"""A trainer-agent process broadcasts its weights to a replica-agent process, driven as the controller will.

PrepareWeightSync on the trainer -> a plan built from its answer (trainer at
rank 0, the replica at rank 1) -> SendWeights and ReceiveWeights at the same
time. Both servers run as real processes over gloo on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest

from mesh_runtime.errors import error_info
from modeling.presets import build_preset_model
from rollmesh.common.v1 import generation_pb2, types_pb2, weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as replica_pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from rollmesh.trainer.v1 import trainer_agent_pb2 as trainer_pb
from rollmesh.trainer.v1 import trainer_agent_pb2_grpc
from rollmesh.weights.v1 import weight_source_pb2 as ws
from rollmesh.weights.v1 import weight_source_pb2_grpc
from tests.processes import clean_env, running_server
from tests.replica_agent.weight_sender import greedy as local_greedy
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

PROMPT = [5, 6, 7]
TOKENS = 16
TRAINER_YAML = """
node_id: t0
model: tiny-llama
model_seed: 5
initial_weight_version: 7
adopt_requested_versions: true
weight_transfer: {gloo_interface: lo, setup_timeout_s: 60}
"""
REPLICA_YAML = """
node_id: rnode
slots: 1
model: tiny-llama
model_seed: 0
replicas:
  - {replica_id: r0, kind: STANDALONE}
weight_transfer: {gloo_interface: lo, setup_timeout_s: 60}
"""


@dataclasses.dataclass
class Mesh:
    trainer_address: str
    replica_address: str
    trainer_log: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer-broadcast")
    (tmp / "trainer.yaml").write_text(TRAINER_YAML)
    (tmp / "replica.yaml").write_text(REPLICA_YAML)
    env = clean_env(GLOO_SOCKET_IFNAME="lo")
    with running_server("trainer-agent", ["--config", str(tmp / "trainer.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "trainer.log", env=env) as (trainer, _), \
         running_server("replica-agent", ["--config", str(tmp / "replica.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "replica.log", env=env) as (replica, _):
        yield Mesh(trainer, replica, tmp / "trainer.log")


@pytest.fixture
async def stubs(mesh):
    async with grpc.aio.insecure_channel(mesh.trainer_address) as trainer_channel, \
               grpc.aio.insecure_channel(mesh.replica_address) as replica_channel:
        # the trainer agent's weight source (WeightSourceService) and the replica agent
        yield (weight_source_pb2_grpc.WeightSourceServiceStub(trainer_channel),
               replica_agent_pb2_grpc.ReplicaAgentServiceStub(replica_channel))


def plan_from(prepared: ws.PrepareWeightSyncResponse, sync_id: str, group_id: str = "g-1",
              replicas: tuple[str, ...] = ("r0",)) -> weights_pb2.WeightSyncPlan:
    """What the controller builds from the PrepareWeightSync answer."""
    plan = weights_pb2.WeightSyncPlan(
        sync_id=sync_id, weight_version=prepared.weight_version, group_id=group_id,
        rendezvous_host=prepared.rendezvous_host, rendezvous_port=prepared.rendezvous_port,
        world_size=len(replicas) + 1, backend=weights_pb2.PROCESS_GROUP_BACKEND_GLOO, manifest=prepared.manifest,
        source=prepared.source,
        members=[weights_pb2.WeightSyncMember(rank=0)] +
                [weights_pb2.WeightSyncMember(rank=i + 1, replica_id=r) for i, r in enumerate(replicas)])
    plan.timeout.FromSeconds(60)
    return plan


async def replica_greedy(replica, request_id: str) -> list[int]:
    request = replica_pb.GenerateRequest(
        replica_id="r0", request_id=request_id, prompt_token_ids=PROMPT,
        sampling_params=generation_pb2.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    return [t async for msg in replica.Generate(request, timeout=60) for t in msg.token_ids]


async def broadcast(trainer, replica, plan):
    return await asyncio.gather(
        trainer.SendWeights(ws.SendWeightsRequest(plan=plan), timeout=90),
        replica.ReceiveWeights(replica_pb.ReceiveWeightsRequest(replica_ids=["r0"], plan=plan, abort_in_flight=True),
                               timeout=90))


async def test_the_replica_serves_the_trainers_weights_after_a_sync_and_a_second_sync_reuses_the_group(mesh, stubs):
    trainer, replica = stubs
    async with grpc.aio.insecure_channel(mesh.trainer_address) as channel:
        status = await trainer_agent_pb2_grpc.TrainerAgentServiceStub(channel).GetStatus(
            trainer_pb.GetStatusRequest(), timeout=10)
    assert "weights" in status.status.capabilities and status.training_backend == "torch"
    assert status.model == "tiny-llama" and status.rank == 0 and status.world_size == 1
    expected = local_greedy(build_preset_model("tiny-llama", 5).eval(), PROMPT, TOKENS)
    assert await replica_greedy(replica, "before") != expected  # seed 0 on the replica, seed 5 on the trainer

    prepared = await trainer.PrepareWeightSync(ws.PrepareWeightSyncRequest(), timeout=30)
    assert prepared.weight_version == 7 and prepared.source == "trainer-t0"
    assert f"{prepared.rendezvous_host}:{prepared.rendezvous_port}" == status.weight_rendezvous_address
    assert prepared.manifest.bucket_size_bytes == 16 << 20 and prepared.manifest.checksum

    sent, received = await broadcast(trainer, replica, plan_from(prepared, "sync-1"))
    [result] = received.results
    assert result.checksum_ok and result.weight_version == 7
    assert (sent.weight_version, sent.bytes_sent, sent.checksum) == (
        7, prepared.manifest.total_bytes, prepared.manifest.checksum)
    assert await replica_greedy(replica, "after") == expected
    replica_state = await replica.GetReplica(replica_pb.GetReplicaRequest(replica_id="r0"), timeout=10)
    assert replica_state.replica.weight_version == 7

    # Same version in smaller buckets: a new layout of the same stream, sent over the cached group.
    again = await trainer.PrepareWeightSync(
        ws.PrepareWeightSyncRequest(weight_version=7, bucket_size_bytes=64 << 10), timeout=30)
    assert again.manifest.checksum == prepared.manifest.checksum
    assert again.manifest.total_bytes > 4 * again.manifest.bucket_size_bytes
    repeated_prepare = await trainer.PrepareWeightSync(
        ws.PrepareWeightSyncRequest(weight_version=7, bucket_size_bytes=64 << 10), timeout=30)
    assert repeated_prepare == again
    sent_again, received_again = await broadcast(trainer, replica, plan_from(again, "sync-2"))
    assert received_again.results[0].checksum_ok and sent_again.weight_version == 7
    log = mesh.trainer_log.read_text()
    assert "over a new group g-1" in log and "over a reused group g-1" in log
    assert await replica_greedy(replica, "after-again") == expected

    repeated = await trainer.SendWeights(ws.SendWeightsRequest(plan=plan_from(again, "sync-2")), timeout=5)
    assert repeated == sent_again  # a finished sync_id answers its recorded result, sends nothing

    # The controller numbers versions by its steps; with no training loop here the trainer adopts them.
    adopted = await trainer.PrepareWeightSync(ws.PrepareWeightSyncRequest(weight_version=8), timeout=30)
    assert adopted.weight_version == 8 and adopted.manifest.checksum == prepared.manifest.checksum
    _, received = await broadcast(trainer, replica, plan_from(adopted, "sync-3"))
    assert received.results[0].weight_version == 8
    assert await replica_greedy(replica, "adopted") == expected


def _reason(err: grpc.aio.AioRpcError) -> str:
    info = error_info(err)
    return info.reason if info is not None else ""


async def test_a_request_arriving_during_a_sync_waits_for_the_new_weights(mesh, stubs):
    # rather than being refused (and bounced between replicas that are all syncing), it runs on the new version
    trainer, replica = stubs
    current = await trainer.PrepareWeightSync(ws.PrepareWeightSyncRequest(), timeout=30)
    nxt = await trainer.PrepareWeightSync(
        ws.PrepareWeightSyncRequest(weight_version=current.weight_version + 1), timeout=30)
    plan = plan_from(nxt, "sync-during", group_id="g-during")
    receiving = asyncio.ensure_future(replica.ReceiveWeights(
        replica_pb.ReceiveWeightsRequest(replica_ids=["r0"], plan=plan, abort_in_flight=True), timeout=90))

    async def syncing() -> bool:
        reply = await replica.GetReplica(replica_pb.GetReplicaRequest(replica_id="r0"), timeout=10)
        return reply.replica.state == types_pb2.REPLICA_STATE_SYNCING

    await wait_until(syncing, 30, what="the replica to be in its sync, waiting for the sender at the rendezvous")
    request = replica_pb.GenerateRequest(
        replica_id="r0", request_id="during-sync", prompt_token_ids=PROMPT,
        sampling_params=generation_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    generating = asyncio.ensure_future(_messages(replica.Generate(request, timeout=60)))
    assert await syncing()   # the sender has not joined: the replica cannot leave SYNCING before SendWeights
    await trainer.SendWeights(ws.SendWeightsRequest(plan=plan), timeout=90)
    assert (await receiving).results[0].weight_version == nxt.weight_version
    messages = await generating   # not refused (UNAVAILABLE) although it came while the replica was syncing
    assert messages[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert {m.weight_version for m in messages if m.token_ids} == {nxt.weight_version}


async def _messages(call) -> list:
    return [m async for m in call]


async def test_bad_plans_are_refused_before_any_transfer(mesh, stubs):
    trainer, _ = stubs
    prepared = await trainer.PrepareWeightSync(ws.PrepareWeightSyncRequest(), timeout=30)

    def malformed_world(plan):
        plan.world_size = 3

    def no_sync_id(plan):
        plan.sync_id = ""

    def wrong_source(plan):
        plan.source = "trainer-elsewhere"

    def wrong_version(plan):
        plan.weight_version = prepared.weight_version + 1

    def other_manifest(plan):
        plan.manifest.checksum = "00"

    cases = [
        (malformed_world, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SYNC_PLAN", "world_size"),
        (no_sync_id, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SYNC_PLAN", "sync_id is empty"),
        (wrong_source, grpc.StatusCode.FAILED_PRECONDITION, "NOT_PLAN_SOURCE", "trainer-t0"),
        (wrong_version, grpc.StatusCode.FAILED_PRECONDITION, "VERSION_MISMATCH", "call PrepareWeightSync"),
        (other_manifest, grpc.StatusCode.FAILED_PRECONDITION, "MANIFEST_MISMATCH", "checksum"),
    ]
    groups_before = mesh.trainer_log.read_text().count("weight group")
    for change, code, reason, fragment in cases:
        plan = plan_from(prepared, f"bad-{change.__name__}", group_id=f"g-{change.__name__}")
        change(plan)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            # No receiver ever joins: a refusal has to come before the rendezvous, well within 5 s.
            await trainer.SendWeights(ws.SendWeightsRequest(plan=plan), timeout=5)
        assert (info.value.code(), _reason(info.value)) == (code, reason), change.__name__
        assert fragment in info.value.details()
    assert mesh.trainer_log.read_text().count("weight group") == groups_before  # no group was started

    for request, code in [
        (ws.PrepareWeightSyncRequest(bucket_size_bytes=0), grpc.StatusCode.INVALID_ARGUMENT),
        (ws.PrepareWeightSyncRequest(checksum_algorithm="md5"), grpc.StatusCode.INVALID_ARGUMENT),
        (ws.PrepareWeightSyncRequest(weight_version=-2), grpc.StatusCode.INVALID_ARGUMENT),
        (ws.PrepareWeightSyncRequest(weight_version=3), grpc.StatusCode.FAILED_PRECONDITION),
        (ws.PrepareWeightSyncRequest(source_id="r0"), grpc.StatusCode.NOT_FOUND),   # not the trainer's source
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await trainer.PrepareWeightSync(request, timeout=10)
        assert info.value.code() == code, request
