"""Controller, balancer and agents as real processes: registration, routing, leases, events, restart."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2, types_pb2

from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from tests.processes import running_server
from tests.waiting import wait_until as wait_for

pytestmark = pytest.mark.timeout(180)

AGENT = """node_id: {node}
slots: 3
backend: synthetic
controller_address: {controller}
engine_options: {{tokens_per_second: 40, lengths: {{kind: fixed, value: 100000}}}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
  - {{replica_id: {node}-h0, kind: HYBRID}}
"""


async def test_lease_loss_fails_replicas_resumes_requests_and_survives_a_controller_restart(tmp_path):
    state = tmp_path / "state"
    with running_server("lb", ["--listen", "127.0.0.1:0"], log_path=tmp_path / "lb.log") as (lb, _):
        (tmp_path / "controller.yaml").write_text(
            f"load_balancer_address: {lb}\nlease_ttl_s: 2.0\nload_report_interval_s: 0.2\nstate_dir: {state}\n")
        controller_cm = running_server("controller", ["--config", str(tmp_path / "controller.yaml"), "--listen",
                                                      "127.0.0.1:0"], log_path=tmp_path / "controller.log")
        controller, controller_proc = controller_cm.__enter__()
        try:
            agents = []
            for node in ("a", "b"):
                (tmp_path / f"{node}.yaml").write_text(AGENT.format(node=node, controller=controller))
                cm = running_server("replica-agent", ["--config", str(tmp_path / f"{node}.yaml"), "--listen",
                                                      "127.0.0.1:0"], log_path=tmp_path / f"{node}.log")
                agents.append((cm, *cm.__enter__()))
            async with grpc.aio.insecure_channel(controller) as cch, grpc.aio.insecure_channel(lb) as lch:
                ctl = controller_pb2_grpc.ControllerServiceStub(cch)
                bal = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lch)

                async def routed():
                    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
                    return sorted(r.endpoint.replica_id for r in reply.replicas)

                assert await wait_for(lambda: _eq(routed, ["a-s0", "b-s0"]))
                listed = await ctl.ListReplicas(registry_pb2.ListReplicasRequest())
                kinds = {r.replica_id: (r.kind, r.state) for r in listed.replicas}
                assert kinds["a-h0"] == (types_pb2.REPLICA_KIND_HYBRID, types_pb2.REPLICA_STATE_SLEEPING)
                assert kinds["a-s0"] == (types_pb2.REPLICA_KIND_STANDALONE, types_pb2.REPLICA_STATE_ACTIVE)

                watch = ctl.WatchEvents(observability_pb2.WatchEventsRequest(
                    types=[events_pb2.EVENT_TYPE_LEASE_EXPIRED, events_pb2.EVENT_TYPE_REPLICA_STATE_CHANGED]))
                requests = [asyncio.create_task(_generate(bal, f"q{i}", 60)) for i in range(8)]
                await asyncio.sleep(0.5)
                agents[0][2].send_signal(signal.SIGKILL)  # node a dies with requests in flight
                expired = []
                async for message in watch:
                    # Node b's own activation event can arrive after its route shows on the balancer
                    # (the event and the route are written independently); only node a's events matter.
                    if message.event.node_id != "a" and not message.event.replica_id.startswith("a-"):
                        continue
                    expired.append(message.event)
                    if sum(e.to_state == "REPLICA_STATE_FAILED" for e in expired) == 2:
                        break
                watch.cancel()
                assert expired[0].type == events_pb2.EVENT_TYPE_LEASE_EXPIRED and expired[0].node_id == "a"
                assert {e.replica_id for e in expired[1:]} == {"a-s0", "a-h0"}
                assert await routed() == ["b-s0"]
                finals = await asyncio.gather(*requests)
                assert all(f.finish_reason == generation_pb2.FINISH_REASON_LENGTH and f.usage.completion_tokens == 60
                           for f in finals)
                last_sequence = (await ctl.GetStatus(_status())).last_event_sequence

            # The controller restarts: the registry and the event numbering come back.
            controller_cm.__exit__(None, None, None)
            controller_cm = running_server("controller", ["--config", str(tmp_path / "controller.yaml"), "--listen",
                                                          controller], log_path=tmp_path / "controller2.log")
            controller, controller_proc = controller_cm.__enter__()
            async with grpc.aio.insecure_channel(controller) as cch:
                ctl = controller_pb2_grpc.ControllerServiceStub(cch)
                listed = await ctl.ListReplicas(registry_pb2.ListReplicasRequest())
                states = {r.replica_id: r.state for r in listed.replicas}
                assert states["a-s0"] == types_pb2.REPLICA_STATE_FAILED and states["b-s0"] == types_pb2.REPLICA_STATE_ACTIVE
                status = await ctl.GetStatus(_status())
                assert status.last_event_sequence > last_sequence
                node_b = await wait_for(lambda: _node_reported(ctl, "b"))
                assert node_b.lease_held
        finally:
            for cm, _, proc in agents:
                if proc.poll() is None:
                    cm.__exit__(None, None, None)
            controller_cm.__exit__(None, None, None)


def _status():
    from rollmesh.controller.v1 import controller_pb2

    return controller_pb2.GetStatusRequest()


async def _eq(fn, expected):
    return await fn() == expected


async def _node_reported(ctl, node_id):
    reply = await ctl.GetNode(registry_pb2.GetNodeRequest(node_id=node_id))
    return reply.node if reply.node.last_report_at.seconds else None


async def _generate(bal, request_id: str, max_tokens: int):
    req = lb_pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2],
                                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    final = None
    async for msg in bal.Generate(req, timeout=120):
        final = msg
    return final


