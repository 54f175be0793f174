"""GenerateMany: many generations on one stream of a real agent (in-process, synthetic replicas): the same
results as Generate, errors and cancellation per generation, and every generation aborted when the stream
ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.replica_agent.in_process import synthetic_agent
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def agent():
    async with synthetic_agent(["r0", "r1"]) as (server, address):
        async with grpc.aio.insecure_channel(address) as channel:
            yield replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel), server


def generate(request_id: str, replica_id: str = "r0", max_tokens: int = 24, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(replica_id=replica_id, request_id=request_id, prompt_token_ids=[1, 2, 3],
                              sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, seed=7), **kw)


async def single(stub, request: pb.GenerateRequest) -> list[int]:
    return [t async for msg in stub.Generate(request, timeout=30) for t in msg.token_ids]


def one(**action) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(actions=[pb.GenerateManyAction(**action)])


class Stream:
    """One GenerateMany call: send actions, collect each generation's items."""

    def __init__(self, stub) -> None:
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.items: dict[str, list[pb.GenerateManyItem]] = {}
        self.responses = 0
        self.call = stub.GenerateMany(self._requests(), timeout=30)
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self):
        while (request := await self.outgoing.get()) is not None:
            yield request

    async def _read(self):
        async for response in self.call:
            self.responses += 1
            for item in response.items:
                self.items.setdefault(item.request_id, []).append(item)

    def ended(self, request_id: str) -> bool:
        got = self.items.get(request_id, [])
        return bool(got) and (got[-1].HasField("error") or got[-1].response.finish_reason != 0)

    def tokens(self, request_id: str) -> list[int]:
        return [t for item in self.items[request_id] for t in item.response.token_ids]


async def test_many_generations_on_one_stream_equal_their_generate_calls(agent):
    stub, _ = agent
    stream = Stream(stub)
    ids = [f"m{i}" for i in range(12)]
    for i, rid in enumerate(ids):
        stream.outgoing.put_nowait(one(generate=generate(rid, f"r{i % 2}", stream_interval=4)))
    await wait_until(lambda: all(stream.ended(rid) for rid in ids), 20)
    for i, rid in enumerate(ids):
        final = stream.items[rid][-1].response
        assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH and final.usage.completion_tokens == 24
        assert stream.tokens(rid) == [t for s in final.segments for t in s.token_ids]
        assert all(len(item.response.token_ids) <= 4 for item in stream.items[rid])
        assert stream.tokens(rid) == await single(stub, generate(f"single-{rid}", f"r{i % 2}"))  # same seed
    assert stream.responses < sum(len(v) for v in stream.items.values())   # chunks of several shared messages
    stream.outgoing.put_nowait(None)
    await asyncio.wait_for(stream.reader, 10)   # the caller closed its side: the stream ends


async def test_a_bad_generation_fails_alone_and_a_cancelled_one_is_aborted(agent):
    stub, server = agent
    stream = Stream(stub)
    stream.outgoing.put_nowait(one(generate=generate("long", max_tokens=100000)))
    stream.outgoing.put_nowait(one(generate=generate("bad", replica_id="nope")))
    stream.outgoing.put_nowait(one(generate=generate("zero", max_tokens=0)))
    stream.outgoing.put_nowait(one(generate=generate("ok")))
    await wait_until(lambda: all(stream.ended(r) for r in ("bad", "zero", "ok")) and "long" in stream.items, 20)
    assert stream.items["bad"][-1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert stream.items["zero"][-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "max_tokens" in stream.items["zero"][-1].error.message
    assert stream.items["ok"][-1].response.usage.completion_tokens == 24
    replicas = server.services[0].servicer.replicas
    assert "long" in replicas.get("r0").in_flight
    stream.outgoing.put_nowait(one(cancel_request_id="long"))
    await wait_until(lambda: "long" not in replicas.get("r0").in_flight, 10)   # aborted in the engine
    seen = len(stream.items["long"])
    stream.outgoing.put_nowait(one(generate=generate("after")))
    await wait_until(lambda: stream.ended("after"), 10)
    assert len(stream.items["long"]) == seen and not stream.ended("long")   # nothing more was sent for it


async def test_every_generation_on_a_stream_is_aborted_when_its_caller_goes_away(agent):
    stub, server = agent
    stream = Stream(stub)
    for rid in ("a", "b", "c"):
        stream.outgoing.put_nowait(one(generate=generate(rid, max_tokens=100000)))
    replicas = server.services[0].servicer.replicas
    await wait_until(lambda: len(replicas.get("r0").in_flight) == 3, 10)
    stream.call.cancel()
    await wait_until(lambda: not replicas.get("r0").in_flight, 10)
