"""Weight receive into real agent replicas from a separate sender process over gloo."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2, types_pb2, weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(240)

SENDER = Path(__file__).with_name("weight_sender.py")
AGENT_YAML = """
node_id: wnode
slots: 3
replicas:
  - {replica_id: s0, kind: STANDALONE}
  - {replica_id: s1, kind: STANDALONE}
  - {replica_id: h0, kind: HYBRID}
weight_transfer: {gloo_interface: lo, setup_timeout_s: 60}
"""


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "replica-processes"])
def agent(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("wagent")
    (tmp / "agent.yaml").write_text(AGENT_YAML + f"replica_processes: {str(request.param).lower()}\n")
    with running_server("replica-agent", ["--config", str(tmp / "agent.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "agent.log", env=clean_env(GLOO_SOCKET_IFNAME="lo")) as (address, _):
        yield address


class Sender:
    def __init__(self, group: str, receivers: list[str], *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SENDER), "--group", group,
                                      "--members", ",".join(["trainer", *receivers]), *extra],
                                     stdout=subprocess.PIPE, text=True, env=clean_env(GLOO_SOCKET_IFNAME="lo"))
        info = json.loads(self.proc.stdout.readline())
        self.port, self.manifest, self.greedy = info["port"], info["manifest"], info["greedy"]
        self.receivers = receivers

    def plan(self, sync_id: str, version: int) -> weights_pb2.WeightSyncPlan:
        plan = weights_pb2.WeightSyncPlan(
            sync_id=sync_id, weight_version=version, group_id=sync_id, rendezvous_host="127.0.0.1",
            rendezvous_port=self.port, world_size=len(self.receivers) + 1,
            backend=weights_pb2.PROCESS_GROUP_BACKEND_GLOO, source="trainer",
            members=[weights_pb2.WeightSyncMember(rank=0)] +
                    [weights_pb2.WeightSyncMember(rank=i + 1, replica_id=r) for i, r in enumerate(self.receivers)])
        m = self.manifest
        plan.manifest.CopyFrom(weights_pb2.WeightManifest(
            tensors=[weights_pb2.TensorSpec(**t) for t in m["tensors"]], bucket_size_bytes=m["bucket_size_bytes"],
            total_bytes=m["total_bytes"], checksum=m["checksum"], checksum_algorithm=m["checksum_algorithm"]))
        plan.timeout.FromSeconds(60)
        return plan

    def finish(self) -> str:
        out, _ = self.proc.communicate(timeout=60)
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def greedy(stub, replica: str, request_id: str) -> list[int]:
    req = pb.GenerateRequest(replica_id=replica, request_id=request_id, prompt_token_ids=[5, 6, 7],
                             sampling_params=generation_pb2.SamplingParams(max_tokens=16, temperature=0,
                                                                           ignore_eos=True))
    return [t async for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]


async def test_receive_matches_the_sender_and_corruption_keeps_old_weights(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        before = await greedy(stub, "s0", "b0")
        sender = Sender("sync-1", ["s0"], "--seed", "1")
        reply = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=sender.plan("sync-1", 1)))
        assert "sent" in sender.finish()
        [result] = reply.results
        assert result.checksum_ok and result.weight_version == 1 and result.bytes_received > 0
        assert before != sender.greedy
        assert await greedy(stub, "s0", "a0") == sender.greedy  # bit-identical weights, same greedy output
        assert await greedy(stub, "s1", "untouched") == before
        again = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=sender.plan("sync-1", 1)))
        assert again.results[0].checksum_ok  # a repeated sync_id returns the recorded result

        bad = Sender("sync-2", ["s0"], "--seed", "2", "--corrupt")
        reply = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s0"], plan=bad.plan("sync-2", 2)))
        bad.finish()
        assert not reply.results[0].checksum_ok and reply.results[0].weight_version == 1
        assert await greedy(stub, "s0", "a1") == sender.greedy  # the old weights keep serving
        state = (await stub.GetReplica(pb.GetReplicaRequest(replica_id="s0"))).replica
        assert state.weight_version == 1 and state.state == types_pb2.REPLICA_STATE_ACTIVE


async def test_mismatched_manifest_is_refused_before_any_byte(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        before = await greedy(stub, "s1", "m0")
        other = Sender("sync-q", ["s1"], "--preset", "tiny-qwen2")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s1"], plan=other.plan("sync-q", 5)))
        finally:
            other.kill()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert await greedy(stub, "s1", "m1") == before
        assert (await stub.GetReplica(pb.GetReplicaRequest(replica_id="s1"))).replica.weight_version == 0


async def test_deep_sleep_frees_memory_and_needs_weights_before_serving(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        await stub.WakeUp(pb.WakeUpRequest(replica_id="h0", resume_generation=True))
        slept = await stub.Sleep(pb.SleepRequest(replica_id="h0", level=types_pb2.SLEEP_LEVEL_2))
        print(f"sleep level 2 freed {slept.freed_bytes} bytes")
        assert slept.freed_bytes > 100_000
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await greedy(stub, "h0", "asleep")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        sender = Sender("sync-h", ["h0", "s1"], "--seed", "3")
        reply = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["h0", "s1"],
                                                                   plan=sender.plan("sync-h", 3)))
        sender.finish()
        assert [(r.replica_id, r.checksum_ok, r.weight_version) for r in reply.results] == [("h0", True, 3),
                                                                                             ("s1", True, 3)]
        asleep = (await stub.GetReplica(pb.GetReplicaRequest(replica_id="h0"))).replica
        assert asleep.state == types_pb2.REPLICA_STATE_SLEEPING  # received into fresh memory, still asleep
        await stub.WakeUp(pb.WakeUpRequest(replica_id="h0", resume_generation=True))
        assert await greedy(stub, "h0", "woken") == sender.greedy == await greedy(stub, "s1", "peer")


async def test_a_request_in_flight_is_aborted_before_the_new_weights_serve(agent):
    # the abort runs while the stream arrives; it ends before any weight changes, so the aborted request's
    # tokens all come from the old version, and the sync itself succeeds
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        old = (await stub.GetReplica(pb.GetReplicaRequest(replica_id="s1"))).replica.weight_version
        sender = Sender("sync-f", ["s1"], "--seed", "4")   # started first: the request runs for about a second
        req = pb.GenerateRequest(replica_id="s1", request_id="long", prompt_token_ids=[5, 6, 7],
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=500, temperature=0,
                                                                               ignore_eos=True))
        stream = stub.Generate(req, timeout=120)
        chunks = [await stream.read()]   # it runs
        reply = await stub.ReceiveWeights(pb.ReceiveWeightsRequest(replica_ids=["s1"], plan=sender.plan("sync-f", 9),
                                                                   abort_in_flight=True))
        sender.finish()
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert reply.results[0].checksum_ok and reply.results[0].weight_version == 9
        final = chunks[-1]
        assert final.finish_reason == generation_pb2.FINISH_REASON_ABORTED
        assert 0 < sum(len(c.token_ids) for c in chunks) < 500
        assert {c.weight_version for c in chunks if c.token_ids} == {old}
        assert {s.weight_version for s in final.segments} == {old}
        assert await asyncio.wait_for(greedy(stub, "s1", "after"), 60) == sender.greedy
