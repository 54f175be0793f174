"""The controller's section-4 metrics over gRPC equal a hand computation from the step reports."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, scheduling_pb2
from tests.processes import running_server

pytestmark = pytest.mark.timeout(120)


def secs(value: float) -> duration_pb2.Duration:
    out = duration_pb2.Duration()
    out.FromNanoseconds(int(value * 1e9))
    return out


def point(t: float, active: int, capacity: int) -> scheduling_pb2.ConcurrencySample:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return scheduling_pb2.ConcurrencySample(time=ts, active_tasks=active, capacity=capacity)


async def test_metrics_match_the_reference_formulas(tmp_path):
    (tmp_path / "c.yaml").write_text("hybrid_gpus: 8\nstandalone_gpus: 8\nconcurrent_samples_per_replica: 4\n"
                                     "max_required_samples: 16\nmetrics_listen: 127.0.0.1:0\n")
    with running_server("controller", ["--config", str(tmp_path / "c.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp_path / "c.log") as (address, _):
        timing = {"reward": 1.0, "old_log_prob": 2.0, "ref": 1.0, "adv": 0.5, "update_actor": 3.5, "step": 10.0,
                  "param_sync": 0.7}
        report = scheduling_pb2.StepReport(
            required_samples=8, trigger_parameter_sync_step=1, queue_size=5, step_generated_samples=12,
            timing_raw={k: secs(v) for k, v in timing.items()}, train_allocated_time=secs(10.0),
            rollout_concurrency=[point(1000, 4, 8), point(1002, 8, 8), point(1004, 2, 16), point(1006, 0, 16)])
        async with grpc.aio.insecure_channel(address) as channel:
            ctl = controller_pb2_grpc.ControllerServiceStub(channel)
            await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=1, report=report))
            await ctl.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(global_step=1, weight_version=1,
                                                                                        report=report))
            [cycle] = (await ctl.GetMetrics(observability_pb2.GetMetricsRequest())).cycles
        values = dict(cycle.values)
        compute = 1.0 + 2.0 + 1.0 + 0.5 + 3.5                 # section 4.1 keys; param_sync/step excluded
        u_train = compute / 10.0                               # 0.8
        u_rollout = (2 * min(8, 4) + 2 * min(8, 8) + 2 * min(16, 2)) / (2 * 8 + 2 * 8 + 2 * 16)  # 28/64
        x = 0.0                                                # no deactivation wait this cycle
        a, b = 8, 8
        u_cluster = ((1 - x) * a * u_train + (x * a + b) * u_rollout) / (a + b)
        assert values["dynamic_resource/train_compute_time_s"] == pytest.approx(compute)
        assert values["dynamic_resource/train_allocated_time_s"] == pytest.approx(10.0)
        assert values["dynamic_resource/train_resource_utilization"] == pytest.approx(u_train)
        assert values["dynamic_resource/rollout_resource_utilization"] == pytest.approx(u_rollout)
        assert values["dynamic_resource/resource_utilization"] == pytest.approx(u_cluster)
        assert values["dynamic_resource/mq_size"] == 5
        assert values["fully_async/rollouter/step_generated_samples"] == 12
        assert cycle.cycle == 1 and cycle.weight_version == 1 and cycle.global_step == 1

        log = (tmp_path / "c.log").read_text()
        assert "Traceback" not in log
        scrape = _scrape(tmp_path)
        # each closed cycle is one observation of a histogram per value; sizes are gauges, counts counters
        assert "rollmesh_dynamic_resource_train_resource_utilization_ratio_sum 0.8" in scrape
        assert "rollmesh_dynamic_resource_train_resource_utilization_ratio_count 1.0" in scrape
        assert "rollmesh_dynamic_resource_train_compute_time_seconds_sum 8.0" in scrape
        assert "rollmesh_dynamic_resource_mq_size 5.0" in scrape
        assert "rollmesh_fully_async_rollouter_generated_samples_total 12.0" in scrape
        assert "rollmesh_dynamic_resource_cycles_total 1.0" in scrape
        assert 'rollmesh_controller_weight_syncs_total{outcome="completed"}' in scrape
        assert 'rollmesh_controller_replicas{' not in scrape or "kind=" in scrape
        assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="CompleteTrainingStep"' in scrape
        assert "process_cpu_seconds_total" in scrape


def _scrape(tmp_path) -> str:
    import re

    log = (tmp_path / "c.log").read_text()
    match = re.search(r"Prometheus metrics on (\S+)", log)
    assert match, "the controller logs its metrics address"
    return urllib.request.urlopen(match.group(1), timeout=10).read().decode()
