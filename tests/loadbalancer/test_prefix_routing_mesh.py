"""Prefix-aware routing end to end (in-process balancer, a real agent with two synthetic replicas on the
engine model): a GRPO group lands where its prompt is cached and reports it, and so does a trajectory's next
turn; replicas report their cache in load reports."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.server import SPEC
from loadbalancer.service import LoadBalancerServicer
from mesh_runtime.config import load_config
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from tests.replica_agent.in_process import synthetic_agent
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
MODEL = {"engine_model": {"speed": 50.0, "block_size": 16}, "tokens_per_step": 4}


@pytest.fixture
async def balancer():
    servers = []

    async def make(policy: str):
        config = load_config(LoadBalancerConfig, None, overrides={
            "listen": "127.0.0.1:0", "routing_policy": policy,
            "prefix_routing": {"block_tokens": 16, "max_load_gap": 8}})   # a group of 8 sent at once stays
        spec = dataclasses.replace(SPEC, make_servicer=lambda c, t: LoadBalancerServicer(c, t))
        lb, port = await spec.create(config, None)
        servers.append(lb)
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}")

    yield make
    for server in servers:
        await server.stop(0)


async def generate(stub, request_id: str, prompt: list[int], session: str = "") -> pb.GenerateResponse:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, session_id=session, final_only=True,
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=20, ignore_eos=True))
    return [m async for m in stub.Generate(request)][-1]


async def run_group(policy: str, balancer) -> tuple[list[pb.GenerateResponse], pb.GenerateResponse, dict]:
    async with synthetic_agent(["r0", "r1"], engine_options=MODEL) as (_, address):
        channel = await balancer(policy)
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
            routing_pb2.ReplicaEndpoint(replica_id=r, address=address) for r in ("r0", "r1")]))
        prompt = [(13 * i) % 30000 + 2 for i in range(400)]
        group = await asyncio.gather(*(generate(stub, f"g{i}", prompt) for i in range(8)))
        turn2 = await generate(stub, "next", prompt + list(group[0].token_ids) + [9] * 30)
        stats = (await stub.GetStats(pb.GetStatsRequest())).stats
        agent = replica_agent_pb2_grpc.ReplicaAgentServiceStub(grpc.aio.insecure_channel(address))
        reports = await agent.GetLoadReports(replica_agent_pb2.GetLoadReportsRequest())
        caches = {r.replica_id: r.prefix_cache_tokens for r in reports.reports}
        await channel.close()
        return group, turn2, {"hits": stats.prefix_hits, "caches": caches}


async def test_a_group_and_the_next_turn_go_where_the_prompt_is_cached(balancer):
    group, turn2, seen = await run_group("prefix_aware", balancer)
    assert {m.attempts[-1].replica_id for m in group} == {group[0].attempts[-1].replica_id}
    assert sorted(m.usage.cached_tokens for m in group) == [0] + [384] * 7   # 24 of 25 blocks of 16
    assert turn2.attempts[-1].replica_id == group[0].attempts[-1].replica_id
    assert turn2.usage.cached_tokens >= 400 // 16 * 16
    assert seen["hits"] == 8 and max(seen["caches"].values()) >= 400
    # least loaded spreads the same group over both replicas: each prefills it
    spread, _, _ = await run_group("least_loaded", balancer)
    assert len({m.attempts[-1].replica_id for m in spread}) == 2
    assert sorted(m.usage.cached_tokens for m in spread).count(0) == 2


@pytest.mark.parametrize("kv_events", [True, False])
async def test_with_kv_events_the_index_forgets_what_the_engine_evicted(kv_events):
    servicers = []
    options = {"engine_model": {"speed": 50.0, "block_size": 16, "kv_capacity_tokens": 2048}, "tokens_per_step": 4}
    async with synthetic_agent(["r0", "r1"], engine_options=options) as (_, address):
        config = load_config(LoadBalancerConfig, None, overrides={
            "listen": "127.0.0.1:0", "routing_policy": "prefix_aware",
            # with events the engine's 16-token blocks are adopted over the table's default of 64
            "prefix_routing": {"kv_events": True} if kv_events else {"block_tokens": 16}})

        def servicer(c, t):
            servicers.append(LoadBalancerServicer(c, t))
            return servicers[-1]
        lb, port = await dataclasses.replace(SPEC, make_servicer=servicer).create(config, None)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
                await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
                    routing_pb2.ReplicaEndpoint(replica_id=r, address=address) for r in ("r0", "r1")]))
                index = servicers[0].table.prefix.index
                first = [(17 * i) % 30000 + 2 for i in range(400)]
                home = (await generate(stub, "a", first)).attempts[-1].replica_id
                keys = index.prompt(first)
                if kv_events:   # the engine's own blocks arrive: 24 prompt blocks and the whole sequence's
                    await wait_until(lambda: servicers[0].prefix_watchers.applied >= 2, timeout_s=10)
                    assert index.block_size(home) == 16 and index.match(keys, {home}) == {home: 400}
                for k in range(12):   # other prompts fill both caches (2,048 tokens each) many times over
                    await generate(stub, f"o{k}", [(31 * i + k) % 30000 + 2 for i in range(400)])
                left = index.match(keys, {home}).get(home, 0)
                if kv_events:
                    await wait_until(lambda: index.match(keys, {home}).get(home, 0) == 0, timeout_s=10)
                else:
                    assert left == 400   # predicted: still there, though the engine evicted it long ago
        finally:
            await lb.stop(0)
