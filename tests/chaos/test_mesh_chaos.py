"""The chaos suite: a synthetic-engine mesh under a seeded schedule of crashes, freezes and stray calls.

A controller with a state directory, a balancer and three replica agents (two
replicas each) run as processes on fixed loopback ports, so each can be
killed and started again where it was. At least 1,000 requests with unique
ids stream through the balancer at concurrency 32 (until every fault is through) while, on a seeded random schedule,
an agent is SIGKILLed and restarted, the controller is SIGKILLed and
restarted, the balancer is SIGKILLed and restarted, an agent is frozen
(SIGSTOP) for longer than its lease, a stray RemoveReplicas takes a replica
out of routing, and an agent is killed for good.

Asserted: every request completes (a caller whose balancer died retries the
same request id, as any client must), none yields more than one result,
none exceeds its max_tokens, none outlives its deadline by more than 1 s,
and after the faults the routing table holds exactly the replicas of the
live agents.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest

from launcher.processes import start_server
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2
from tests.processes import clean_env, free_port

pytestmark = pytest.mark.timeout(240)

REQUESTS = 1000
CONCURRENCY = 32
DEADLINE_S = 60.0
LEASE_TTL_S = 3.0
AGENT = """node_id: {node}
slots: 2
backend: synthetic
controller_address: {controller}
stream_interval: 4
engine_options: {{tokens_per_second: 80, max_batch_size: 256, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: {node}-0}}, {{replica_id: {node}-1}}]
"""
CONTROLLER = f"""load_balancer_address: {{lb}}
state_dir: {{state}}
lease_ttl_s: {LEASE_TTL_S}
load_report_interval_s: 0.3
reconcile_interval_s: 0.5
"""



class Mesh:
    """The mesh's processes by name, each restartable at its address."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = clean_env()
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in ("lb", "controller", "a0", "a1", "a2")}
        self.procs: dict[str, object] = {}
        self.log: list[str] = []
        (root / "state").mkdir()
        (root / "controller.yaml").write_text(CONTROLLER.format(lb=self.addresses["lb"], state=root / "state"))
        (root / "lb.yaml").write_text("{}\n")
        for node in ("a0", "a1", "a2"):
            (root / f"{node}.yaml").write_text(AGENT.format(node=node, controller=self.addresses["controller"]))

    async def start(self, name: str) -> None:
        server = {"lb": "lb", "controller": "controller"}.get(name, "replica-agent")
        self.procs[name] = await start_server(server, ["--config", str(self.root / f"{name}.yaml"),
                                                       "--listen", self.addresses[name]], env=self.env,
                                              log_path=self.root / f"{name}.log", ready_timeout_s=60)

    async def kill(self, name: str) -> None:
        await self.procs.pop(name).kill()

    def freeze(self, name: str, frozen: bool) -> None:
        os.kill(self.procs[name].pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    async def routed(self) -> set[str]:
        async with grpc.aio.insecure_channel(self.addresses["lb"]) as channel:
            reply = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).ListReplicas(
                lb_pb.ListReplicasRequest(), timeout=5)
        return {r.endpoint.replica_id for r in reply.replicas}

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.process.returncode is None:
                os.kill(proc.pid, signal.SIGCONT)
        await asyncio.gather(*(p.terminate(10) for p in self.procs.values()), return_exceptions=True)


async def _faults(mesh: Mesh, rng: random.Random, done: asyncio.Event) -> None:
    async def pause() -> None:
        await asyncio.sleep(rng.uniform(1.5, 3.0))

    steps = [("restart", "a1"), ("restart", "controller"), ("restart", "lb"), ("freeze", "a2"),
             ("stray-remove", ""), ("kill-for-good", "a0")]
    head, tail = steps[:-1], steps[-1:]
    rng.shuffle(head)
    for action, name in head + tail:   # the agent killed for good goes last, so two agents stay
        await pause()
        mesh.log.append(f"{time.monotonic():.1f} {action} {name}")
        if action == "restart":
            await mesh.kill(name)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await mesh.start(name)
        elif action == "freeze":
            mesh.freeze(name, True)
            await asyncio.sleep(LEASE_TTL_S + 1.5)
            mesh.freeze(name, False)
        elif action == "stray-remove":
            async with grpc.aio.insecure_channel(mesh.addresses["lb"]) as channel:
                routed = sorted(await mesh.routed())
                await loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).RemoveReplicas(
                    lb_pb.RemoveReplicasRequest(replica_ids=routed[:1]), timeout=5)
        else:
            await mesh.kill(name)
    done.set()


async def _request(mesh: Mesh, request_id: str, max_tokens: int) -> dict:
    """One caller: retries the same id while the balancer is unreachable (its process died)."""
    started = time.monotonic()
    req = lb_pb.GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finals, tries = [], 0
    while True:
        tries += 1
        remaining = DEADLINE_S - (time.monotonic() - started)
        received: list[int] = []
        try:
            async with grpc.aio.insecure_channel(mesh.addresses["lb"]) as channel:
                async for msg in loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).Generate(
                        req, timeout=max(remaining, 0.1)):
                    if msg.restarted:
                        received = []
                    received += msg.token_ids
                    if msg.finish_reason:
                        finals.append(msg)
            break
        except grpc.aio.AioRpcError as err:
            if finals:   # the result arrived before the stream broke
                break
            if err.code() != grpc.StatusCode.UNAVAILABLE or remaining <= 1:
                return {"error": f"{err.code().name}: {err.details()}", "tries": tries,
                        "elapsed": time.monotonic() - started}
            await asyncio.sleep(0.2)
    return {"finals": finals, "received": received, "tries": tries, "elapsed": time.monotonic() - started}


async def test_every_request_completes_exactly_once_through_crashes_freezes_and_stray_calls(tmp_path):
    mesh = Mesh(tmp_path)
    rng = random.Random(20261201)
    try:
        await mesh.start("lb")
        await mesh.start("controller")
        await asyncio.gather(*(mesh.start(a) for a in ("a0", "a1", "a2")))
        deadline = time.monotonic() + 30
        while len(await mesh.routed()) < 6:
            assert time.monotonic() < deadline, "the mesh never routed all six replicas"
            await asyncio.sleep(0.2)

        budgets: dict[str, int] = {}
        results: dict[str, dict] = {}
        faults_done = asyncio.Event()

        async def caller() -> None:
            while len(budgets) < REQUESTS or not faults_done.is_set():   # load until every fault is through
                request_id = f"c{len(budgets)}"
                budgets[request_id] = rng.randint(16, 64)
                results[request_id] = await _request(mesh, request_id, budgets[request_id])

        faults = asyncio.create_task(_faults(mesh, rng, faults_done))
        await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
        await faults

        failed = {rid: r for rid, r in results.items() if "error" in r}
        assert not failed, (list(failed.items())[:5], mesh.log)
        for request_id, result in results.items():
            assert len(result["finals"]) == 1, request_id                     # exactly one result
            final = result["finals"][0]
            tokens = [t for s in final.segments for t in s.token_ids]
            assert len(tokens) == final.usage.completion_tokens == budgets[request_id], request_id  # never over
            assert result["received"] == tokens, request_id                   # what the caller saw is the result
            assert result["elapsed"] <= DEADLINE_S + 1.0, request_id
        assert len(results) >= REQUESTS
        # the faults did hit requests: callers whose balancer died, attempts cut by crashes, freezes, removals
        assert sum(r["tries"] > 1 for r in results.values()) >= 1, mesh.log
        broken = [a for r in results.values() for a in r["finals"][0].attempts
                  if a.outcome in (routing_pb2.ATTEMPT_OUTCOME_UNAVAILABLE, routing_pb2.ATTEMPT_OUTCOME_ABORTED)]
        assert len(broken) >= 10, mesh.log
        print(f"chaos: {len(results)} requests, {sum(r['tries'] > 1 for r in results.values())} retried by their "
              f"caller, {len(broken)} attempts cut; faults: {mesh.log}")

        expected = {"a1-0", "a1-1", "a2-0", "a2-1"}                          # a0 was killed for good
        deadline = time.monotonic() + LEASE_TTL_S + 10
        while (routed := await mesh.routed()) != expected:
            assert time.monotonic() < deadline, (routed, mesh.log)
            await asyncio.sleep(0.2)
    finally:
        await mesh.stop()
