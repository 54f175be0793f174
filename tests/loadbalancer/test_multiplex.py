"""The balancer's GenerateMany client (:mod:`loadbalancer.multiplex`) against a real in-process agent: an
attempt on the shared stream reads like a Generate call, fails like one (its own status with ErrorInfo, a
deadline, the stream breaking), cancels like one; an agent is sent attempts on a stream once it listed the
generate_many capability, and Generate calls otherwise."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loadbalancer.multiplex import agent_streams
from mesh_runtime.errors import error_info
from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.loadbalancer.fake_replica import start_fake
from tests.replica_agent.in_process import synthetic_agent
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def agent():
    async with synthetic_agent(["r0"]) as (server, address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
            streams = agent_streams(lambda _: stub)
            assert await streams.check(address)   # it lists the generate_many capability
            yield streams, stub, address, server
            await streams.close()


def request(request_id: str, max_tokens: int = 20, replica_id: str = "r0") -> pb.GenerateRequest:
    return pb.GenerateRequest(replica_id=replica_id, request_id=request_id, prompt_token_ids=[1, 2, 3],
                              sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, seed=3))


def start(streams, address, stub, req, timeout_s=None):
    return streams.generate(address, req, timeout_s, {}, lambda: stub.Generate(req, timeout=timeout_s))


async def test_attempts_on_one_stream_read_like_generate_calls(agent):
    streams, stub, address, _ = agent
    calls = [start(streams, address, stub, request(f"a{i}")) for i in range(8)]
    async def drain(call):
        return [m async for m in call]
    results = await asyncio.gather(*(drain(call) for call in calls))
    for i, messages in enumerate(results):
        assert messages[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        direct = [m async for m in stub.Generate(request(f"d{i}"), timeout=30)]
        assert [t for m in messages for t in m.token_ids] == [t for m in direct for t in m.token_ids]
    assert address not in streams.unsupported and len(streams._streams) == 1


async def test_an_attempt_fails_with_its_own_status_and_the_others_go_on(agent):
    streams, stub, address, _ = agent
    good = start(streams, address, stub, request("good"))
    bad = start(streams, address, stub, request("bad", replica_id="missing"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in bad:
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "REPLICA_NOT_FOUND"
    assert [m async for m in good][-1].usage.completion_tokens == 20


async def test_cancel_raises_cancelled_in_the_reader_and_aborts_in_the_engine(agent):
    streams, stub, address, server = agent
    call = start(streams, address, stub, request("long", max_tokens=100000))
    first = await anext(call)
    assert first.token_ids
    replica = server.services[0].servicer.replicas.get("r0")
    read = asyncio.ensure_future(anext(call))
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    await wait_until(lambda: "long" not in replica.in_flight, 10)


async def test_a_deadline_ends_the_attempt_with_deadline_exceeded(agent):
    streams, stub, address, server = agent
    call = start(streams, address, stub, request("slow", max_tokens=100000), timeout_s=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    replica = server.services[0].servicer.replicas.get("r0")
    await wait_until(lambda: "slow" not in replica.in_flight, 10)


async def test_a_broken_stream_fails_every_attempt_on_it_and_the_next_one_opens_a_new_stream(agent):
    streams, stub, address, _ = agent
    calls = [start(streams, address, stub, request(f"k{i}", max_tokens=100000)) for i in range(3)]
    for call in calls:
        await anext(call)
    next(iter(streams._streams.values()))._call.cancel()   # as when the agent's process dies
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in call:
                pass
    again = start(streams, address, stub, request("after"))
    assert [m async for m in again][-1].usage.completion_tokens == 20


async def test_an_agent_without_generate_many_gets_generate_calls():
    server, fake, address = await start_fake({"old": "ok"})
    try:
        channel = grpc.aio.insecure_channel(address)
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        streams = agent_streams(lambda _: stub)
        first = start(streams, address, stub, request("f1", max_tokens=6, replica_id="old"))   # while it probes
        assert [m async for m in first][-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        await wait_until(lambda: address in streams.unsupported, 10)   # no GetStatus, no GenerateMany
        second = start(streams, address, stub, request("f2", max_tokens=6, replica_id="old"))
        assert [m async for m in second][-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        await streams.close()
        await channel.close()
    finally:
        await server.stop(0)


async def test_a_burst_of_long_prompts_travels_in_messages_of_bounded_size(agent):
    streams, _, address, _ = agent
    prompt = [(7 * i) % 30000 + 2 for i in range(40_000)]            # ~110 KB a request: 64 of them ~7 MB
    calls = [streams.generate(address, pb.GenerateRequest(
        replica_id="r0", request_id=f"long-{i}", prompt_token_ids=prompt,
        sampling_params=generation_pb2.SamplingParams(max_tokens=2, seed=i)), 60, {}, None) for i in range(64)]

    async def read(call):
        return [m async for m in call]

    results = await asyncio.gather(*(read(c) for c in calls))
    assert all(r[-1].finish_reason for r in results)


async def test_batches_split_at_the_byte_bound_and_keep_the_order():
    from mesh_runtime.multiplex import batches

    queue: asyncio.Queue = asyncio.Queue()
    items = [pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5] * 300) for i in range(10)]
    for item in items:
        queue.put_nowait(item)
    queue.put_nowait(None)
    size = items[0].ByteSize()
    got = [batch async for batch in batches(queue, None, max_bytes=3 * size)]
    assert [len(b) for b in got] == [3, 3, 3, 1]
    assert [m.request_id for b in got for m in b] == [m.request_id for m in items]
