"""The balancer's GenerateMany (in-process balancer, scripted fake replicas) and the client that uses it
(:class:`mesh_runtime.generate_many.BalancerGenerations`): each generation on the stream gets what a
Generate call gets (resume after an abort, the exactly-once record, final_only, its own error), a cancelled
one stops its upstream attempt, and a client falls back to Generate calls until the balancer's capability
is known."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mesh_runtime.generate_many import BalancerGenerations
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from tests.loadbalancer.test_balancer import expected, mesh, request  # noqa: F401 - the fixture
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


async def drain(call) -> tuple[list[int], pb.GenerateResponse]:
    tokens, last = [], None
    async for message in call:
        tokens = [] if message.restarted else tokens
        tokens += message.token_ids
        last = message
    return tokens, last


@pytest.fixture
async def client(mesh):  # noqa: F811
    made = []

    async def make(modes, **kw):
        stub, fake, address = await mesh(modes, **kw)
        channel = grpc.aio.insecure_channel(stub.lb_address)
        generations = BalancerGenerations(channel)
        assert await generations.check()   # the balancer lists generate_many
        made.append((generations, channel))
        return generations, stub, fake

    yield make
    for generations, channel in made:
        await generations.close()
        await channel.close()


async def test_generations_on_the_stream_get_what_generate_calls_get(client):
    generations, stub, fake = await client({"a": "abort", "b": "normal"})
    results = await asyncio.gather(*(drain(generations.call(request(f"g{i}", 12), timeout_s=30)) for i in range(6)))
    for tokens, last in results:   # every one aborted on a, resumed on b, exactly the budget
        assert tokens == expected(12) and last.usage.completion_tokens == 12
    only = await drain(generations.call(request("fo", 12, final_only=True), timeout_s=30))
    assert only[0] == expected(12) and only[1].finish_reason != 0
    seen = len(fake.seen)
    again = await drain(generations.call(request("g0", 12), timeout_s=30))   # answered from the record
    assert again[0] == expected(12) and len(fake.seen) == seen


async def test_a_bad_generation_fails_alone_with_its_status(client):
    generations, stub, fake = await client({"a": "normal"})
    good = asyncio.ensure_future(drain(generations.call(request("ok", 8), timeout_s=30)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await drain(generations.call(request("zero", 0), timeout_s=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in caught.value.details()
    assert (await good)[0] == expected(8)


async def test_a_cancelled_generation_cancels_its_upstream_attempt(client):
    generations, stub, fake = await client({"a": "stall"})
    call = generations.call(request("hang", 8), timeout_s=30)
    reader = asyncio.ensure_future(drain(call))
    await wait_until(lambda: fake.seen, 10)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    await wait_until(lambda: "hang" in fake.cancelled, 10)   # the balancer cancelled its attempt


async def test_a_deadline_ends_a_generation_with_deadline_exceeded(client):
    generations, stub, fake = await client({"a": "stall"})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await drain(generations.call(request("late", 8), timeout_s=0.5))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: "late" in fake.cancelled, 10)
