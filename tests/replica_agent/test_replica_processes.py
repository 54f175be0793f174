"""``replica_processes: true``: each replica in a process of its own, supervised by the node's agent.

In-process agent, real replica processes: generations through the agent and straight from the replica's
process give the same exact-length results; lifecycle calls sent to the agent reach the process; a replica
process SIGKILLed is that replica FAILED (slots freed, calls refused), the other replica keeps serving and the
failed one can be launched again. Then a whole mesh as processes: the controller registers the processes'
data addresses, the balancer streams from them, and a replica process killed mid-run loses no request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh_runtime.channels import open_channel
from mesh_runtime.config import load_config
from replica_agent.process_metrics import fetch_metrics
from replica_agent.config import ReplicaAgentConfig
from replica_agent.server import SPEC
from rollmesh.common.v1 import generation_pb2, types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.controller.scaling.helpers import Procs, lb_stub, replicas, routed, until
from tests.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ACTIVE, SLEEPING, FAILED = (types_pb2.REPLICA_STATE_ACTIVE, types_pb2.REPLICA_STATE_SLEEPING,
                            types_pb2.REPLICA_STATE_FAILED)


def replica_processes(parent: int) -> list[int]:
    """The replica processes started by process ``parent``."""
    out = []
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        with contextlib.suppress(OSError):
            if b"replica_agent.replica_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


@contextlib.asynccontextmanager
async def agent(replica_ids: list[str], tokens_per_second: float = 400, tls: dict | None = None,
                metrics_listen: str = ""):
    config = load_config(ReplicaAgentConfig, None, overrides={"metrics_listen": metrics_listen,
        "listen": "127.0.0.1:0", "node_id": "n0", "slots": len(replica_ids), "backend": "synthetic",
        "replica_processes": True, "replicas": [{"replica_id": r} for r in replica_ids], "tls": tls,
        "engine_options": {"tokens_per_second": tokens_per_second, "lengths": {"kind": "fixed", "value": 100000}}})
    server, port = await SPEC.create(config, None)
    try:
        if tls is not None:
            yield server, f"127.0.0.1:{port}"
            return
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
    finally:
        await server.stop(0)


def request(replica_id: str, request_id: str, max_tokens: int = 40) -> pb.GenerateRequest:
    return pb.GenerateRequest(replica_id=replica_id, request_id=request_id, prompt_token_ids=[5, 6, 7],
                              sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, seed=3,
                                                                            ignore_eos=True))


async def tokens(stub, message: pb.GenerateRequest) -> tuple[list[int], int]:
    out, finish = [], 0
    async for reply in stub.Generate(message):
        out.extend(reply.token_ids)
        finish = reply.finish_reason or finish
    return out, finish


async def test_generations_and_lifecycle_calls_reach_the_replica_process():
    async with agent(["a", "b"]) as (server, stub):
        listed = {r.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}
        assert sorted(listed) == ["a", "b"] and len(replica_processes(os.getpid())) == 2
        a, b = listed["a"], listed["b"]
        assert a.data_address and b.data_address and a.data_address != b.data_address
        assert a.address == b.address != a.data_address and list(a.slots) != list(b.slots)
        status = await stub.GetStatus(pb.GetStatusRequest())
        assert (status.slots_total, status.slots_free, status.replica_count) == (2, 0, 2)

        async with grpc.aio.insecure_channel(a.data_address) as channel:
            direct = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
            via_agent, finish = await tokens(stub, request("a", "r1"))
            straight, _ = await tokens(direct, request("a", "r2"))
            assert len(via_agent) == 40 and finish == generation_pb2.FINISH_REASON_LENGTH
            assert straight == via_agent   # same seed, same replica: the same tokens either way

            slept = await stub.Sleep(pb.SleepRequest(replica_id="a", level=types_pb2.SLEEP_LEVEL_1))
            assert slept.replica.state == SLEEPING and slept.replica.data_address == a.data_address
            assert (await direct.GetReplica(pb.GetReplicaRequest(replica_id="a"))).replica.state == SLEEPING
            woke = await stub.WakeUp(pb.WakeUpRequest(replica_id="a", resume_generation=True))
            assert woke.replica.state == ACTIVE

            # an abort sent to the agent ends a stream served by the process
            long = direct.Generate(request("a", "long", max_tokens=100000))
            await long.read()
            aborted = await stub.AbortRequests(pb.AbortRequestsRequest(
                replica_id="a", requests=pb.RequestIds(request_ids=["long"])))
            assert list(aborted.aborted_request_ids) == ["long"]
            last = await long.read()
            while last is not grpc.aio.EOF and not last.finish_reason:
                last = await long.read()
            assert last.finish_reason == generation_pb2.FINISH_REASON_ABORTED

        paused = await stub.PauseGeneration(pb.PauseGenerationRequest(replica_ids=["a", "b"]))
        assert sorted(r.replica_id for r in paused.replicas) == ["a", "b"]
        assert all(r.state == types_pb2.REPLICA_STATE_PAUSED for r in paused.replicas)
        resumed = await stub.ResumeGeneration(pb.ResumeGenerationRequest())
        assert all(r.state == ACTIVE for r in resumed.replicas)
        reports = await stub.GetLoadReports(pb.GetLoadReportsRequest())
        assert sorted(r.replica_id for r in reports.reports) == ["a", "b"]

        # the process validates; its errors come back unchanged, and unknown replicas are the agent's
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.Sleep(pb.SleepRequest(replica_id="a", level=7))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "level" in bad.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Sleep(pb.SleepRequest(replica_id="zz", level=1))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert (await stub.GetReplica(pb.GetReplicaRequest(replica_id="a"))).replica.state == ACTIVE
    assert replica_processes(os.getpid()) == []   # the agent's stop ended them


async def test_a_killed_replica_process_fails_that_replica_only_and_can_be_launched_again():
    async with agent(["a", "b"]) as (server, stub):
        before = {r.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}
        pids = replica_processes(os.getpid())
        os.kill(pids[0], signal.SIGKILL)

        async def one_failed():
            now = {r.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}
            failed = [r for r in now.values() if r.state == FAILED]
            return failed[0] if len(failed) == 1 else None
        dead = await until(one_failed, 20, what="the killed replica FAILED")
        assert "SIGKILL" in dead.state_reason and not dead.data_address == ""
        alive = "b" if dead.replica_id == "a" else "a"
        assert (await stub.GetStatus(pb.GetStatusRequest())).slots_free == 1
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Sleep(pb.SleepRequest(replica_id=dead.replica_id, level=1))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        got, _ = await tokens(stub, request(alive, "still"))
        assert len(got) == 40

        again = await stub.LaunchReplica(pb.LaunchReplicaRequest(replica_id=dead.replica_id,
                                                                 kind=types_pb2.REPLICA_KIND_STANDALONE))
        assert again.replica.state == ACTIVE and again.replica.data_address != before[dead.replica_id].data_address
        got, _ = await tokens(stub, request(dead.replica_id, "again"))
        assert len(got) == 40
        stopped = await stub.StopReplica(pb.StopReplicaRequest(replica_id=alive))
        assert stopped.replica.state == types_pb2.REPLICA_STATE_STOPPED
        assert len(replica_processes(os.getpid())) == 1


async def test_the_agents_metrics_include_what_each_replica_process_counted():
    metrics = f"127.0.0.1:{free_port()}"
    async with agent(["a", "b"], metrics_listen=metrics) as (server, stub):
        await tokens(stub, request("a", "m1", max_tokens=40))
        await tokens(stub, request("b", "m2", max_tokens=25))
        await tokens(stub, request("b", "m3", max_tokens=5))
        text = await fetch_metrics(metrics)
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))   # one family per name: the processes' are merged
    by_name = {f.name: f for f in families}
    generated = {s.labels["replica_id"]: s.value for s in by_name["rollmesh_replica_generated_tokens"].samples
                 if s.name.endswith("_total")}
    assert generated == {"a": 40, "b": 30}
    states = {s.labels["replica_id"]: s.labels["state"] for s in by_name["rollmesh_replica_state"].samples}
    assert states == {"a": "ACTIVE", "b": "ACTIVE"}
    assert any(s.labels.get("replica_id") == "b" for s in by_name["rollmesh_replica_time_to_first_token_seconds"].samples)
    promtool = shutil.which("promtool")
    if promtool is not None:   # the merged exposition keeps Prometheus' format and naming rules
        checked = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
        assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


async def test_with_mutual_tls_the_process_takes_its_agents_calls_and_no_other_nodes(pki):
    async with agent(["a"], tls=pki.section("replica-agent", "n0")) as (server, address):
        async with open_channel(address, tls=pki.tls("controller")) as channel:
            stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
            replica = (await stub.GetReplica(pb.GetReplicaRequest(replica_id="a"))).replica
            slept = await stub.Sleep(pb.SleepRequest(replica_id="a", level=types_pb2.SLEEP_LEVEL_1))
            assert slept.replica.state == SLEEPING   # forwarded with the agent's certificate
            await stub.WakeUp(pb.WakeUpRequest(replica_id="a", resume_generation=True))
        async with open_channel(replica.data_address, tls=pki.tls("lb")) as channel:
            got, _ = await tokens(replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel), request("a", "t1"))
            assert len(got) == 40   # a balancer streams from the process
        async with open_channel(replica.data_address, tls=pki.tls("replica-agent", "n1")) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as denied:   # another node's agent is not its agent
                await replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel).Sleep(
                    pb.SleepRequest(replica_id="a", level=types_pb2.SLEEP_LEVEL_1))
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


CONTROLLER = """state_dir: {state}
lease_ttl_s: 3
load_report_interval_s: 0.3
reconcile_interval_s: 0.5
"""
AGENT = """node_id: n0
slots: 2
backend: synthetic
controller_address: {controller}
replica_processes: true
stream_interval: 4
engine_options: {{tokens_per_second: 100, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: r0}}, {{replica_id: r1}}]
"""


async def test_a_mesh_streams_from_replica_processes_and_loses_no_request_when_one_is_killed(tmp_path):
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "{}\n")
        controller = procs.start("controller", "controller",
                                 f"load_balancer_address: {lb}\n" + CONTROLLER.format(state=tmp_path / "state"))
        procs.start("n0", "replica-agent", AGENT.format(controller=controller))
        agent_pid = procs.procs["n0"][1].pid
        async with grpc.aio.insecure_channel(lb) as lb_channel, grpc.aio.insecure_channel(controller) as ctl_channel:
            bal, ctl = lb_stub(lb_channel), controller_pb2_grpc.ControllerServiceStub(ctl_channel)

            async def both_routed():
                return await routed(bal) == ["r0", "r1"]
            await until(both_routed, 60, what="both replicas routed")
            records = await replicas(ctl)
            table = {r.endpoint.replica_id: r.endpoint.address
                     for r in (await bal.ListReplicas(lb_pb.ListReplicasRequest())).replicas}
            for replica_id in ("r0", "r1"):   # the balancer streams from the processes, not from the agent
                assert records[replica_id].data_address == table[replica_id] != records[replica_id].address

            async def one(i: int) -> list[int]:
                out = []
                async for reply in bal.Generate(lb_pb.GenerateRequest(
                        request_id=f"q{i}", prompt_token_ids=[1, 2, 3 + i % 5],
                        sampling_params=generation_pb2.SamplingParams(max_tokens=60, ignore_eos=True)),
                        timeout=120):
                    out.extend(reply.token_ids)
                return out

            running = [asyncio.create_task(one(i)) for i in range(64)]
            await asyncio.sleep(0.4)   # all streaming, none finished (60 tokens at 100 tokens/s)
            os.kill(replica_processes(agent_pid)[0], signal.SIGKILL)
            results = await asyncio.gather(*running)
            assert all(len(r) == 60 for r in results)

            async def one_failed():
                states = {k: r.state for k, r in (await replicas(ctl)).items()}
                return sorted(states.values()) == sorted([ACTIVE, FAILED]) and await routed(bal) != ["r0", "r1"]
            await until(one_failed, 30, what="the killed replica FAILED at the controller and out of routing")
            stats = (await bal.GetStats(lb_pb.GetStatsRequest())).stats
            assert stats.failed == 0 and stats.completed == 64
            assert stats.resumes > 0   # the killed process's streams went on elsewhere from their tokens
    finally:
        procs.close()
