"""The autoscaler end to end: synthetic load drives a scale-out, and when the load stops, a scale-in.

Real balancer, controller (with ``autoscaler_config``, short durations) and a
replica agent with a synthetic engine whose KV cache is small, so long
prompts push token usage over the scale-out threshold. Load reports are the
only input. Checked: the history records (the reference's fields), the
decision events, the spans, that the new replica serves, and that every
request completes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import autoscaler_pb2, scaling_pb2
from tests.controller.scaling.helpers import get_op
from tests.controller.scaling.helpers import Procs, controller_stub, events_of, generate, lb_stub, routed, until
from tests.otlp_receiver import start_receiver
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
scale_in_drain_timeout: 5
autoscaler_config: {autoscaler}
"""
AUTOSCALER = """enabled: true
min_engines: 1
max_engines: 2
scale_out_cooldown_secs: 1
scale_in_cooldown_secs: 1
metrics_interval_secs: 0.2
evaluation_interval_secs: 0.4
condition_window_secs: 5
# The engines report latency p95 over 60 s, so queue time and TTFT stay high long after the load;
# this test drives scaling by token usage alone.
scale_out_policy: {token_usage_threshold: 0.5, condition_duration_secs: 1, max_delta: 2,
                   queue_time_p95_threshold: 1000, ttft_p95_threshold: 1000}
scale_in_policy: {token_usage_threshold: 0.1, condition_duration_secs: 2, throughput_variance_threshold: 0.5}
condition_durations: {throughput_stable_secs: 2}
"""


async def test_synthetic_load_scales_out_then_in(tmp_path):
    otlp, receiver, otlp_port = await start_receiver()
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}", OTEL_BSP_SCHEDULE_DELAY="100")
    procs = Procs(tmp_path, env=env)
    (tmp_path / "autoscaler.yaml").write_text(AUTOSCALER)
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(
            lb=lb, autoscaler=tmp_path / "autoscaler.yaml"))
        procs.agent("a", controller=ctl_addr, slots=2, tps=20, extra=", max_total_tokens: 1000")
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _eq(routed(bal), ["a-s0"]))
            status = (await ctl.GetAutoscalerStatus(autoscaler_pb2.GetAutoscalerStatusRequest())).status
            assert status.configured and status.enabled and status.running and status.current_engines == 1

            stop = asyncio.Event()
            results: list = []

            async def load():
                running: set[asyncio.Task] = set()
                index = 0
                while not stop.is_set():
                    while len(running) < 8:
                        task = asyncio.create_task(generate(bal, f"q{index}", 60, prompt_len=300))
                        index += 1
                        running.add(task)
                    done, running = await asyncio.wait(running, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
                    results.extend(t.result() for t in done)
                results.extend(await asyncio.gather(*running))

            driver = asyncio.create_task(load())
            out = await until(lambda: _record(ctl, autoscaler_pb2.SCALE_ACTION_SCALE_OUT,
                                              scaling_pb2.OPERATION_STATE_ACTIVE), timeout_s=90)
            assert (out.from_engines, out.to_engines, out.delta) == (1, 2, 1)  # capped by max_engines
            assert out.reason.startswith("Conditions met") and out.triggered_conditions
            assert out.metrics_snapshot["avg_token_usage"] > 0.5 and out.completed_at.seconds
            new = [r for r in await routed(bal) if r != "a-s0"]
            assert len(new) == 1
            await until(lambda: _reporting(ctl, 2))  # both replicas' load reports feed the metrics
            await until(lambda: _served(bal, new[0]), timeout_s=60)  # the new replica takes load
            stop.set()
            await driver
            assert results and all(r.usage.completion_tokens == 60 for r in results)

            scale_in = await until(lambda: _record(ctl, autoscaler_pb2.SCALE_ACTION_SCALE_IN,
                                                   scaling_pb2.OPERATION_STATE_COMPLETED), timeout_s=90)
            assert (scale_in.from_engines, scale_in.to_engines, scale_in.delta) == (2, 1, -1)
            assert set(scale_in.triggered_conditions) == {"token_usage_low", "no_queue", "throughput_stable"}
            assert await routed(bal) == ["a-s0"]
            op = await get_op(ctl, scale_in.operation_id)
            assert op.triggered_by == "autoscaler" and list(op.replica_ids) == new

            history = await ctl.ListScaleHistory(autoscaler_pb2.ListScaleHistoryRequest())
            assert [h.action for h in history.history][:2] == [autoscaler_pb2.SCALE_ACTION_SCALE_IN,
                                                              autoscaler_pb2.SCALE_ACTION_SCALE_OUT]
            only_out = await ctl.ListScaleHistory(autoscaler_pb2.ListScaleHistoryRequest(
                action=autoscaler_pb2.SCALE_ACTION_SCALE_OUT, limit=1))
            assert [h.operation_id for h in only_out.history] == [out.operation_id] and only_out.total_count == 1
            status = (await ctl.GetAutoscalerStatus(autoscaler_pb2.GetAutoscalerStatusRequest())).status
            assert status.last_scale_action == autoscaler_pb2.SCALE_ACTION_SCALE_IN and not status.pending_operation_ids
            decisions = await events_of(ctl, events_pb2.EVENT_TYPE_AUTOSCALER_DECISION)
            actions = {e.attributes["action"] for e in decisions}
            assert {"scale_out", "scale_in", "none"} <= actions
            started = [e for e in decisions if e.operation_id]
            assert [e.operation_id for e in started] == [out.operation_id, scale_in.operation_id]
            await receiver.wait_for(lambda spans: {"autoscaler.decide", "scale.out", "scale.in"}
                                    <= {s.name for s in spans if s.service == "rollmesh-controller"})
    finally:
        procs.close()
        await otlp.stop(None)


async def _eq(coro, expected):
    return await coro == expected


async def _reporting(ctl, engines):
    reply = await ctl.GetAutoscalerConditions(autoscaler_pb2.GetAutoscalerConditionsRequest())
    return reply.metrics.num_engines == engines and len(reply.conditions) == 7


async def _record(ctl, action, state):
    history = await ctl.ListScaleHistory(autoscaler_pb2.ListScaleHistoryRequest(action=action))
    return next((h for h in history.history if h.state == state), None)


async def _served(bal, replica_id):
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb

    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return any(r.endpoint.replica_id == replica_id and r.completed > 0 for r in reply.replicas)
