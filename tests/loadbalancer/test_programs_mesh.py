"""Program admission end to end (in-process balancer, a real agent with two synthetic replicas on the engine
model): the balancer learns each replica's KV capacity from the agent's load reports, admits programs while
their contexts fit, and holds the next one until a session closes."""

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
from tests.replica_agent.in_process import synthetic_agent
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
MODEL = {"engine_model": {"speed": 50.0, "kv_capacity_tokens": 2000}, "tokens_per_step": 4}


async def turn(stub, request_id: str, session: str) -> pb.GenerateResponse:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[(7 * i) % 30000 + 2 for i in range(880)],
                                 session_id=session, final_only=True,
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=20, ignore_eos=True))
    return [m async for m in stub.Generate(request)][-1]


async def test_programs_fill_each_replica_to_its_reported_kv_and_the_next_waits_for_a_close():
    config = load_config(LoadBalancerConfig, None, overrides={
        "listen": "127.0.0.1:0", "routing_policy": "least_loaded",
        "program_admission": {"enabled": True, "report_interval_s": 0.2}})
    servicers: list[LoadBalancerServicer] = []
    spec = dataclasses.replace(SPEC, make_servicer=lambda c, t: servicers.append(LoadBalancerServicer(c, t))
                               or servicers[-1])
    lb, port = await spec.create(config, None)
    try:
        async with synthetic_agent(["r0", "r1"], engine_options=MODEL) as (_, address):
            programs = servicers[0].balancer.programs
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
                await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
                    routing_pb2.ReplicaEndpoint(replica_id=r, address=address) for r in ("r0", "r1")]))
                await wait_until(lambda: programs.capacity == {"r0": 2000, "r1": 2000}, 10,
                                 what="the agent's reported KV capacity")
                # 880 prompt tokens + 20 expected: 900 a program, two to a replica's 2,000
                first = await asyncio.gather(*(turn(stub, f"s{i}-0", f"s{i}") for i in range(4)))
                placed = [m.attempts[-1].replica_id for m in first]
                fifth = asyncio.ensure_future(turn(stub, "s4-0", "s4"))
                await wait_until(lambda: programs.waiting == 1, 10, what="the fifth program waiting")
                await asyncio.sleep(0.3)
                assert not fifth.done()
                closed = await stub.CloseSession(pb.CloseSessionRequest(session_id="s2"))
                done = await asyncio.wait_for(fifth, 10)
                stats = (await stub.GetStats(pb.GetStatsRequest())).stats
    finally:
        await lb.stop(0)
    assert sorted(placed) == ["r0", "r0", "r1", "r1"]
    assert closed.replica_id == placed[2] and done.attempts[-1].replica_id == placed[2]
    assert len(done.token_ids) == 20 and stats.program_waits == 1
