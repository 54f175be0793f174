"""Seed-replica weight sync on a real agent: the agent's WeightSourceService (PrepareWeightSync, then
SendWeights) from one replica to another.

A separate sender process first puts known weights (preset seed 3) into s0 at
version 2; s0 then prepares itself as a source and broadcasts to s1 over gloo.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from rollmesh.weights.v1 import weight_source_pb2 as ws
from rollmesh.weights.v1 import weight_source_pb2_grpc
from tests.processes import clean_env, running_server
from tests.replica_agent.test_weight_receive import Sender, greedy

pytestmark = pytest.mark.timeout(240)

AGENT_YAML = """
node_id: snode
slots: 2
replicas:
  - {replica_id: s0, kind: STANDALONE}
  - {replica_id: s1, kind: STANDALONE}
weight_transfer: {gloo_interface: lo, setup_timeout_s: 60, bucket_size_bytes: 65536}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "replica-processes"])
def agent(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("sagent")
    (tmp / "agent.yaml").write_text(AGENT_YAML + f"replica_processes: {str(request.param).lower()}\n")
    with running_server("replica-agent", ["--config", str(tmp / "agent.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "agent.log", env=clean_env(GLOO_SOCKET_IFNAME="lo")) as (address, _):
        yield address


def seed_plan(prepared: ws.PrepareWeightSyncResponse, sync_id: str, receivers: list[str]):
    plan = weights_pb2.WeightSyncPlan(
        sync_id=sync_id, weight_version=prepared.weight_version, group_id=sync_id,
        rendezvous_host=prepared.rendezvous_host, rendezvous_port=prepared.rendezvous_port,
        world_size=len(receivers) + 1, backend=weights_pb2.PROCESS_GROUP_BACKEND_GLOO, source=prepared.source,
        manifest=prepared.manifest,
        members=[weights_pb2.WeightSyncMember(rank=0, replica_id=prepared.source)] +
                [weights_pb2.WeightSyncMember(rank=i + 1, replica_id=r) for i, r in enumerate(receivers)])
    plan.timeout.FromSeconds(60)
    return plan


async def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.details()  # a clear message, never an empty one
    return info.value.code()


async def test_prepare_rejects_bad_input(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        source = weight_source_pb2_grpc.WeightSourceServiceStub(channel)
        prepare = source.PrepareWeightSync
        assert await code_of(prepare(ws.PrepareWeightSyncRequest())) == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(prepare(ws.PrepareWeightSyncRequest(source_id="s0", weight_version=-1))) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(prepare(ws.PrepareWeightSyncRequest(source_id="s0", bucket_size_bytes=0))) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(prepare(ws.PrepareWeightSyncRequest(source_id="s0", checksum_algorithm="md5"))) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(prepare(ws.PrepareWeightSyncRequest(source_id="nope"))) == grpc.StatusCode.NOT_FOUND
        assert await code_of(prepare(ws.PrepareWeightSyncRequest(source_id="s1", weight_version=9))) \
            == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_replica_seeds_another_with_its_exact_weights(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        source = weight_source_pb2_grpc.WeightSourceServiceStub(channel)
        initial = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s1"))
        assert initial.weight_version == 0 and initial.source == "s1"
        sender = Sender("fill-s0", ["s0"], "--seed", "3")
        reply = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=sender.plan("fill-s0", 2)))
        assert "sent" in sender.finish() and reply.results[0].checksum_ok

        prepared = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s0", weight_version=2))
        assert prepared.weight_version == 2 and prepared.source == "s0" and prepared.rendezvous_port > 0
        # s0 holds exactly the sender's bytes: same layout (64 KiB buckets, wsum64), same checksum.
        assert prepared.manifest.checksum == sender.manifest["checksum"] != initial.manifest.checksum
        assert prepared.manifest.total_bytes == sender.manifest["total_bytes"]
        again = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s0"))
        assert (again.manifest, again.rendezvous_port) == (prepared.manifest, prepared.rendezvous_port)
        sha = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s0", checksum_algorithm="sha256"))
        assert sha.manifest.checksum_algorithm == "sha256" and sha.manifest.checksum != prepared.manifest.checksum

        plan = seed_plan(prepared, "seed-1", ["s1"])
        sent, received = await asyncio.gather(
            source.SendWeights(ws.SendWeightsRequest(source_id="s0", plan=plan), timeout=120),
            stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s1"], plan=plan), timeout=120))
        assert sent.weight_version == 2 and sent.bytes_sent == prepared.manifest.total_bytes
        [result] = received.results
        assert result.checksum_ok and result.weight_version == 2
        after = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(source_id="s1"))
        assert after.weight_version == 2 and after.manifest.checksum == prepared.manifest.checksum
        assert await greedy(stub, "s1", "g1") == sender.greedy == await greedy(stub, "s0", "g0")

        # A stale plan (the seed no longer holds that version) is refused before any byte moves.
        stale = seed_plan(prepared, "seed-2", ["s1"])
        stale.weight_version = 1
        assert await code_of(source.SendWeights(ws.SendWeightsRequest(source_id="s0", plan=stale))) \
            == grpc.StatusCode.FAILED_PRECONDITION
