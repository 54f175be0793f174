"""Deactivation overhead of the control plane (run by hand; prints figures).

Two hybrid replicas are activated through the real step protocol, loaded with
>= 128 in-flight requests, then released (remove -> abort -> sleep). From the
exported spans: the controller's ``hybrid.deactivate`` duration minus the
engines' own abort and sleep time (the agents' server spans) is the
control-plane time. Target: <= 100 ms.

    .venv/bin/python -m benchmarks.bench_deactivation [--requests 192]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import grpc

from launcher.processes import start_server
from rollmesh.common.v1 import generation_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2, scheduling_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from tests.otlp_receiver import start_receiver

AGENT = """node_id: {node}
slots: {slots}
controller_address: {controller}
weight_transfer: {{gloo_interface: lo}}
engine_options: {{max_batch_size: 256}}
replicas: {replicas}
"""


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=192)
    args = parser.parse_args()
    receiver_server, receiver, otlp_port = await start_receiver()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ROLLMESH_"))},
           "GLOO_SOCKET_IFNAME": "lo", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    procs = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        try:
            lb = await start_server("lb", ["--listen", "127.0.0.1:0"], env=env, log_path=tmp / "lb.log")
            (tmp / "trainer.yaml").write_text("weight_transfer: {gloo_interface: lo}\n")
            trainer = await start_server("trainer-agent", ["--config", str(tmp / "trainer.yaml"), "--listen",
                                                           "127.0.0.1:0"], env=env, log_path=tmp / "t.log")
            (tmp / "c.yaml").write_text(
                f"load_balancer_address: {lb.address}\ntrainer_address: {trainer.address}\n"
                "async_training: {use_dynamic_resource_scheduling: true, trigger_parameter_sync_step: 1, "
                "ppo_mini_batch_size: 8}\n")
            controller = await start_server("controller", ["--config", str(tmp / "c.yaml"), "--listen",
                                                           "127.0.0.1:0"], env=env, log_path=tmp / "c.log")
            procs += [lb, trainer, controller]
            for node, slots, replicas in (("sa", 1, "[{replica_id: s0, kind: STANDALONE}]"),
                                          ("hy", 2, "[{replica_id: h0, kind: HYBRID}, {replica_id: h1, kind: HYBRID}]")):
                (tmp / f"{node}.yaml").write_text(AGENT.format(node=node, slots=slots, controller=controller.address,
                                                               replicas=replicas))
                procs.append(await start_server("replica-agent", ["--config", str(tmp / f"{node}.yaml"), "--listen",
                                                                  "127.0.0.1:0"], env=env, log_path=tmp / f"{node}.log"))
            await run(controller.address, lb.address, args.requests, receiver)
        finally:
            await asyncio.gather(*(p.terminate() for p in procs))
            await receiver_server.stop(None)


async def run(controller: str, lb: str, n: int, receiver) -> None:
    async with grpc.aio.insecure_channel(controller) as cch, grpc.aio.insecure_channel(lb) as lch:
        ctl = controller_pb2_grpc.ControllerServiceStub(cch)
        bal = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lch)
        while len((await ctl.ListReplicas(registry_pb2.ListReplicasRequest())).replicas) < 3:
            await asyncio.sleep(0.2)
        print("replicas registered; activating the hybrid replicas", flush=True)
        report = scheduling_pb2.StepReport(required_samples=8, trigger_parameter_sync_step=1, expected_samples=64)
        await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=1, report=report))
        done = await ctl.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(
            global_step=1, weight_version=1, report=report))
        assert done.hybrid_activated, "the hybrid replicas must be active to measure their release"
        print("hybrid replicas activated; loading them with requests", flush=True)

        async def generate(i: int) -> None:
            req = lb_pb.GenerateRequest(request_id=f"b{i}", prompt_token_ids=[1, 2, 3],
                                        sampling_params=generation_pb2.SamplingParams(max_tokens=480, ignore_eos=True))
            async for _ in bal.Generate(req, timeout=600):
                pass

        tasks = [asyncio.create_task(generate(i)) for i in range(n)]
        while True:
            listed = await bal.ListReplicas(lb_pb.ListReplicasRequest())
            on_hybrid = sum(r.in_flight for r in listed.replicas if r.endpoint.replica_id.startswith("h"))
            if on_hybrid >= 128:
                break
            print(f"  {on_hybrid} requests in flight on the hybrid replicas", flush=True)
            await asyncio.sleep(0.5)
        begin = await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=2, report=report))
        released = await ctl.ReleaseHybridReplicas(scheduling_pb2.ReleaseHybridReplicasRequest(
            global_step=2, buffered_samples=begin.wait_samples))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def ready(spans) -> bool:
        return any(s.name == "hybrid.deactivate" for s in spans) and \
            sum(s.service == "rollmesh-replica-agent" and s.name.endswith("/Sleep") for s in spans) >= 2

    await receiver.wait_for(ready, timeout_s=60)
    spans = receiver.spans
    deactivate = next(s for s in spans if s.name == "hybrid.deactivate")
    agent = [s for s in spans if s.service == "rollmesh-replica-agent" and s.kind == 2
             and deactivate.start_ns <= s.start_ns <= deactivate.end_ns]
    abort = max((s.end_ns - s.start_ns for s in agent if s.name.endswith("/AbortRequests")), default=0)
    sleep = max((s.end_ns - s.start_ns for s in agent if s.name.endswith("/Sleep")), default=0)
    remove = max((s.end_ns - s.start_ns for s in spans if s.service == "rollmesh-lb"
                  and s.name.endswith("/RemoveReplicas")), default=0)
    total = deactivate.end_ns - deactivate.start_ns
    print(f"deactivation of 2 hybrid replicas with {on_hybrid} requests in flight on them "
          f"(released: {list(released.released_replica_ids)}, aborted: {released.aborted_requests})")
    print(f"  hybrid.deactivate span:        {total / 1e6:8.1f} ms")
    print(f"  engines' abort (agent spans):  {abort / 1e6:8.1f} ms")
    print(f"  engines' sleep (agent spans):  {sleep / 1e6:8.1f} ms")
    print(f"  balancer RemoveReplicas:       {remove / 1e6:8.1f} ms")
    if os.environ.get("ROLLMESH_BENCH_TIMELINE"):
        for s in sorted(spans, key=lambda s: s.start_ns):
            if deactivate.start_ns <= s.start_ns <= deactivate.end_ns:
                print(f"    +{(s.start_ns - deactivate.start_ns) / 1e6:7.1f} ms {(s.end_ns - s.start_ns) / 1e6:7.1f} ms "
                      f"{s.service:24} {s.name}")
    print(f"  control-plane time:            {(total - abort - sleep) / 1e6:8.1f} ms   (target <= 100 ms)")


if __name__ == "__main__":
    asyncio.run(main())
