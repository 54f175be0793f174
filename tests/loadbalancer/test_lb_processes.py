"""The balancer and replica agents as real processes (synthetic engines): chaos and fairness."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from tests.processes import running_server

pytestmark = pytest.mark.timeout(240)

EOS = 1
AGENT_YAML = """
node_id: {node}
slots: 2
backend: synthetic
stream_interval: 8
engine_options:
  tokens_per_second: 60
  eos_token_id: 1
  lengths: {{kind: uniform, min: 24, max: 96}}
replicas:
  - {{replica_id: {node}-0}}
  - {{replica_id: {node}-1}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lbcluster")
    agents = {}
    with contextlib_exit_stack() as stack:
        for node in ("n0", "n1"):
            path = tmp / f"{node}.yaml"
            path.write_text(AGENT_YAML.format(node=node))
            address, _ = stack.enter_context(running_server("replica-agent", ["--config", str(path), "--listen",
                                                                              "127.0.0.1:0"], log_path=tmp / f"{node}.log"))
            agents[node] = address
        lb_path = tmp / "lb.yaml"
        lb_path.write_text("no_replica_wait_s: 20\nretry_budget: 64\nsticky_max_load_gap: 4\n")
        lb, _ = stack.enter_context(running_server("lb", ["--config", str(lb_path), "--listen", "127.0.0.1:0"],
                                                   log_path=tmp / "lb.log"))
        yield lb, agents


def contextlib_exit_stack():
    import contextlib

    return contextlib.ExitStack()


def endpoints(agents) -> list[routing_pb2.ReplicaEndpoint]:
    return [routing_pb2.ReplicaEndpoint(replica_id=f"{node}-{i}", address=address, node_id=node)
            for node, address in agents.items() for i in range(2)]


async def run_request(stub, request_id: str, max_tokens: int, partial: bool, session: str):
    req = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[3, 4, 5], session_id=session,
                             partial_rollout=partial,
                             sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, seed=hash(request_id) % 1000))
    received, finals = [], []
    async for msg in stub.Generate(req, timeout=120):
        if msg.restarted:
            received = []
        received += msg.token_ids
        if msg.finish_reason:
            finals.append(msg)
    return received, finals


async def chaos(lb_stub, agents, stop: asyncio.Event, rng: random.Random, log: list[str]) -> None:
    channels = {node: grpc.aio.insecure_channel(addr) for node, addr in agents.items()}
    agent_stubs = {node: replica_agent_pb2_grpc.ReplicaAgentServiceStub(ch) for node, ch in channels.items()}
    all_eps = {ep.replica_id: ep for ep in endpoints(agents)}
    removed: set[str] = set()
    try:
        while not stop.is_set():
            action = rng.choice(["abort", "abort", "remove", "readd"])
            replica = rng.choice(sorted(all_eps))
            node = all_eps[replica].node_id
            if action == "abort":
                await agent_stubs[node].AbortRequests(replica_agent_pb2.AbortRequestsRequest(replica_id=replica, all=True))
            elif action == "remove" and replica not in removed and len(removed) < 3:
                await lb_stub.RemoveReplicas(pb.RemoveReplicasRequest(replica_ids=[replica], abort_in_flight=True))
                removed.add(replica)
            elif action == "readd" and removed:
                back = rng.choice(sorted(removed))
                await lb_stub.AddReplicas(pb.AddReplicasRequest(replicas=[all_eps[back]]))
                removed.discard(back)
            log.append(f"{action} {replica}")
            await asyncio.sleep(rng.uniform(0.05, 0.2))
    finally:
        if removed:
            await lb_stub.AddReplicas(pb.AddReplicasRequest(replicas=[all_eps[r] for r in removed]))
        for ch in channels.values():
            await ch.close()


async def test_chaos_every_request_completes_exactly_once_with_its_budget(cluster):
    lb, agents = cluster
    rng = random.Random(7)
    async with grpc.aio.insecure_channel(lb) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        await stub.AddReplicas(pb.AddReplicasRequest(replicas=endpoints(agents)))
        before = (await stub.GetStats(pb.GetStatsRequest())).stats
        budgets = {f"chaos-{i}": rng.randint(16, 64) for i in range(520)}
        partial = {rid: i % 5 != 0 for i, rid in enumerate(budgets)}
        stop, log = asyncio.Event(), []
        chaos_task = asyncio.create_task(chaos(stub, agents, stop, rng, log))
        results = await asyncio.gather(*(run_request(stub, rid, budgets[rid], partial[rid], f"s{i % 40}")
                                         for i, rid in enumerate(budgets)))
        stop.set()
        await chaos_task
        after = (await stub.GetStats(pb.GetStatsRequest())).stats

    assert len([entry for entry in log if entry.startswith("abort")]) > 3
    for (request_id, max_tokens), (received, finals) in zip(budgets.items(), results):
        assert len(finals) == 1, request_id  # exactly one result
        final = finals[0]
        stitched = [t for s in final.segments for t in s.token_ids]
        assert received == stitched, request_id  # what the caller saw is what the segments say
        assert final.usage.completion_tokens == len(stitched)
        if final.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
            assert len(stitched) == max_tokens, request_id
        else:
            assert final.finish_reason == generation_pb2.FINISH_REASON_STOP
            assert len(stitched) <= max_tokens and stitched[-1] == EOS
        assert all(s.replica_id for s in final.segments) and final.attempts[-1].outcome == \
            routing_pb2.ATTEMPT_OUTCOME_COMPLETED
    assert after.completed - before.completed == len(budgets)
    assert after.failed == before.failed
    assert after.resumes + after.regenerations > before.resumes + before.regenerations


async def test_new_sessions_spread_fairly_over_idle_replicas(cluster):
    lb, agents = cluster
    async with grpc.aio.insecure_channel(lb) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        await stub.AddReplicas(pb.AddReplicasRequest(replicas=endpoints(agents)))
        await stub.ClearStickySessions(pb.ClearStickySessionsRequest())
        for i in range(100):
            await run_request(stub, f"fair-{i}", 2, True, f"fair-session-{i}")
        listed = await stub.ListReplicas(pb.ListReplicasRequest())
    counts = {r.endpoint.replica_id: r.sticky_sessions for r in listed.replicas}
    assert sum(counts.values()) == 100
    assert all(20 <= c <= 30 for c in counts.values()), counts
