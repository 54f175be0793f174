"""The replica agent as a real process with the torch backend and a tiny model."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from mesh_runtime.errors import error_info
from rollmesh.common.v1 import generation_pb2, types_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.processes import running_server

pytestmark = pytest.mark.timeout(180)

AGENT_YAML = """
node_id: node-a
slots: 4
stream_interval: 4
metrics_listen: 127.0.0.1:0
replicas:
  - {replica_id: s0, kind: STANDALONE}
  - {replica_id: s1, kind: STANDALONE}
  - {replica_id: h0, kind: HYBRID}
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    (tmp / "agent.yaml").write_text(AGENT_YAML)
    with running_server("replica-agent", ["--config", str(tmp / "agent.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "agent.log") as (address, _):
        yield address


def sampling(max_tokens: int = 12, **kw) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=max_tokens, **kw)


async def generate(stub, replica_id: str, request_id: str, prompt=(5, 6, 7), **kw) -> list[pb.GenerateResponse]:
    call = stub.Generate(pb.GenerateRequest(replica_id=replica_id, request_id=request_id,
                                            prompt_token_ids=list(prompt), **kw), timeout=60)
    return [msg async for msg in call]


def tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def test_sixteen_concurrent_generations_and_deterministic_greedy(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        results = await asyncio.gather(*(
            generate(stub, f"s{i % 2}", f"c{i}", prompt=(1 + i, 2, 3), sampling_params=sampling(10, temperature=1.0, seed=i))
            for i in range(16)))
        for messages in results:
            final = messages[-1]
            assert final.finish_reason in (generation_pb2.FINISH_REASON_LENGTH, generation_pb2.FINISH_REASON_STOP)
            assert final.usage.completion_tokens == len(tokens(messages)) <= 10
            assert all(len(m.token_ids) <= 4 for m in messages[:-1])  # stream_interval 4
        greedy = [tokens(await generate(stub, replica, f"g-{replica}-{n}", sampling_params=sampling(16, temperature=0)))
                  for n in range(2) for replica in ("s0", "s1")]
        assert greedy[0] == greedy[1] == greedy[2] == greedy[3]
        seeded = [tokens(await generate(stub, "s0", f"seeded-{n}", sampling_params=sampling(16, seed=7)))
                  for n in range(2)]
        assert seeded[0] == seeded[1]


async def test_abort_returns_partial_tokens_and_resume_elsewhere_keeps_the_budget(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        full = tokens(await generate(stub, "s1", "ref", sampling_params=sampling(40, temperature=0, ignore_eos=True)))
        assert len(full) == 40
        call = stub.Generate(pb.GenerateRequest(replica_id="s0", request_id="victim", prompt_token_ids=[5, 6, 7],
                                                sampling_params=sampling(40, temperature=0, ignore_eos=True,
                                                                         logprobs=True)), timeout=60)
        first = await call.read()  # generation is under way
        aborted = await stub.AbortRequests(pb.AbortRequestsRequest(
            replica_id="s0", requests=pb.RequestIds(request_ids=["victim"])))
        assert list(aborted.aborted_request_ids) == ["victim"]
        partial = [first]
        while (message := await call.read()) != grpc.aio.EOF:
            partial.append(message)
        assert partial[-1].finish_reason == generation_pb2.FINISH_REASON_ABORTED
        prefix_segments = list(partial[-1].segments)
        prefix = [t for s in prefix_segments for t in s.token_ids]
        assert 0 < len(prefix) < 40 and prefix == tokens(partial)
        resumed = await generate(stub, "s1", "victim", sampling_params=sampling(40, temperature=0, ignore_eos=True),
                                 resume_segments=prefix_segments)
        final = resumed[-1]
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 40 and final.usage.resumed_tokens == len(prefix)
        assert prefix + tokens(resumed) == full  # greedy continuation equals the uninterrupted run
        assert [s.replica_id for s in final.segments] == ["s0", "s1"]
        assert all(s.weight_version == 0 for s in final.segments)


async def test_sleep_wake_cycle_and_unavailable_while_asleep(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        hybrid = (await stub.GetReplica(pb.GetReplicaRequest(replica_id="h0"))).replica
        assert hybrid.state == types_pb2.REPLICA_STATE_SLEEPING and hybrid.initial
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "h0", "asleep", sampling_params=sampling())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "SLEEPING" in info.value.details()

        woken = await stub.WakeUp(pb.WakeUpRequest(replica_id="h0"))
        assert woken.replica.state == types_pb2.REPLICA_STATE_PAUSED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "h0", "paused", sampling_params=sampling())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await stub.ResumeGeneration(pb.ResumeGenerationRequest(replica_ids=["h0"]))
        before = tokens(await generate(stub, "h0", "before", sampling_params=sampling(16, temperature=0)))

        slept = await stub.Sleep(pb.SleepRequest(replica_id="h0", level=types_pb2.SLEEP_LEVEL_1))
        assert slept.freed_bytes > 0 and slept.replica.state == types_pb2.REPLICA_STATE_SLEEPING
        await stub.WakeUp(pb.WakeUpRequest(replica_id="h0", resume_generation=True))
        after = tokens(await generate(stub, "h0", "after", sampling_params=sampling(16, temperature=0)))
        assert before == after  # level-1 sleep restores the weights

        deep = await stub.Sleep(pb.SleepRequest(replica_id="h0", level=types_pb2.SLEEP_LEVEL_2))
        assert deep.freed_bytes > 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.WakeUp(pb.WakeUpRequest(replica_id="h0"))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ReceiveWeights" in info.value.details()
        assert error_info(info.value).reason == "WEIGHTS_DISCARDED"


async def test_bad_input_gets_clear_statuses(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        cases = [
            (dict(replica_id="nope", sampling_params=sampling()), grpc.StatusCode.NOT_FOUND, "nope"),
            (dict(replica_id="s0", sampling_params=sampling(0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
            (dict(replica_id="s0", sampling_params=sampling(4, top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
            (dict(replica_id="s0", sampling_params=sampling(4, temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
             "temperature"),
        ]
        for kwargs, code, fragment in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, request_id="bad", **kwargs)
            assert info.value.code() == code and fragment in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "s0", "empty", prompt=(), sampling_params=sampling())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Sleep(pb.SleepRequest(replica_id="s0"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.LaunchReplica(pb.LaunchReplicaRequest(replica_id="x", kind=types_pb2.REPLICA_KIND_STANDALONE,
                                                             slots=9))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for nothing, says in (({}, "set all"), ({"all": False}, "set all"),
                              ({"requests": pb.RequestIds()}, "requests.request_ids is required")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.AbortRequests(pb.AbortRequestsRequest(replica_id="s0", **nothing))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.details()
        listed = await stub.ListReplicas(pb.ListReplicasRequest())
        assert sorted(r.replica_id for r in listed.replicas) == ["h0", "s0", "s1"]  # nothing changed


async def test_launch_stop_and_load_reports(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        launched = await stub.LaunchReplica(pb.LaunchReplicaRequest(
            replica_id="extra", kind=types_pb2.REPLICA_KIND_STANDALONE, slots=1, request_id="k1"))
        assert launched.replica.state == types_pb2.REPLICA_STATE_ACTIVE and not launched.replica.initial
        again = await stub.LaunchReplica(pb.LaunchReplicaRequest(
            replica_id="extra", kind=types_pb2.REPLICA_KIND_STANDALONE, slots=1, request_id="k1"))
        assert again.replica.replica_id == "extra"
        status = await stub.GetStatus(pb.GetStatusRequest())
        assert status.slots_free == 0 and status.replica_count == 4
        reports = await stub.GetLoadReports(pb.GetLoadReportsRequest(replica_ids=["s0", "extra"]))
        assert [r.replica_id for r in reports.reports] == ["s0", "extra"]
        assert reports.reports[0].max_total_tokens > 0 and reports.reports[0].reported_at.seconds > 0
        stopped = await stub.StopReplica(pb.StopReplicaRequest(replica_id="extra"))
        assert stopped.replica.state == types_pb2.REPLICA_STATE_STOPPED
        assert (await stub.GetStatus(pb.GetStatusRequest())).slots_free == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "extra", "gone", sampling_params=sampling())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_prometheus_endpoint_exposes_load(agent, tmp_path):
    # The agent logs its metrics address; find it via the log of the module fixture's process.
    log = next(tmp_path.parent.glob("agent*/agent.log")).read_text()
    url = log.split("Prometheus metrics on ")[1].split()[0]
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    assert 'rollmesh_replica_kv_cache_usage_ratio{kind="STANDALONE",node_id="node-a",replica_id="s0"}' in body
    assert "# TYPE rollmesh_replica_running_requests gauge" in body
    assert "# TYPE rollmesh_replica_time_to_first_token_seconds histogram" in body


async def test_per_request_stream_interval(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        for interval in (1, 7):
            messages = await generate(stub, "s0", f"iv{interval}", stream_interval=interval,
                                      sampling_params=sampling(15, temperature=0, ignore_eos=True))
            assert [len(m.token_ids) for m in messages[:-1]] == [interval] * (15 // interval - (15 % interval == 0))
            assert len(tokens(messages)) == 15


async def test_replicas_are_listed_in_pages_in_launch_order(agent):
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        everything = [r.replica_id for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas]
        assert {"s0", "s1", "h0"} <= set(everything) and everything.index("s0") < everything.index("h0")
        seen, token = [], ""
        while True:
            reply = await stub.ListReplicas(pb.ListReplicasRequest(page_size=2, page_token=token))
            assert len(reply.replicas) <= 2
            seen, token = seen + [r.replica_id for r in reply.replicas], reply.next_page_token
            if not token:
                break
        assert seen == everything
        first = await stub.ListReplicas(pb.ListReplicasRequest(page_size=1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListReplicas(pb.ListReplicasRequest(page_size=1, page_token=first.next_page_token,
                                                           kinds=[types_pb2.REPLICA_KIND_HYBRID]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(info.value).reason == "INVALID_PAGE_TOKEN"
