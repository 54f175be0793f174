"""Autoscaler core, beyond the reference's examples: jittered sample times and the condition_durations section."""

from __future__ import annotations

import pytest

from controller.scaling.autoscaler import Autoscaler, AutoscalerConfig, MetricsSample


def idle(t: float, tp: float = 100.0) -> MetricsSample:
    return MetricsSample(time=t, num_engines=4, avg_token_usage=0.1, total_queue_reqs=0, queue_time_p95=0.0,
                         ttft_p95=0.0, throughput=tp)


def test_throughput_stable_triggers_when_samples_miss_the_window_edge():
    # Samples every 10.3 s never fall exactly 60 s before the latest one; the window is anchored on the
    # newest sample at or before its start, so it still spans the full 60 s.
    a = Autoscaler()
    times = [round(i * 10.3, 1) for i in range(14)]  # 0 .. 133.9 s
    for t in times:
        a.record_metrics(idle(t))
    c = a.conditions(times[-1])["throughput_stable"]
    assert c.triggered and c.held_for >= 60.0
    assert a.evaluate(times[-1], False).action == "scale_in"
    assert a.samples()[0].time <= times[-1] - 60.0  # the anchor is kept


def test_throughput_window_shorter_than_its_duration_does_not_trigger():
    a = Autoscaler()
    for t in (0.0, 10.0, 20.0, 30.0):
        a.record_metrics(idle(t))
    c = a.conditions(30.0)["throughput_stable"]
    assert not c.triggered and c.held_for == 30.0


def test_condition_durations_section_sets_the_fixed_durations():
    cfg = AutoscalerConfig.from_dict({"condition_durations": {"queue_backlog_secs": 2, "throughput_stable_secs": 5}})
    a = Autoscaler(cfg)
    assert a.conditions(0)["queue_backlog"].required_for == 2
    assert a.conditions(0)["throughput_stable"].required_for == 5
    assert a.conditions(0)["ttft_high"].required_for == 15.0  # the reference's default
    for t in (0.0, 1.0, 2.0):
        a.record_metrics(MetricsSample(time=t, num_engines=2, avg_token_usage=0.5, total_queue_reqs=100,
                                       queue_time_p95=0.0, ttft_p95=0.0, throughput=1.0))
    decision = a.evaluate(2.0, False)
    assert decision.action == "scale_out" and decision.triggered_conditions == ("queue_backlog",)
    assert decision.delta == (100 - 2 * 5) // 20  # the reference's queue_delta: 4


@pytest.mark.parametrize("value", [0, -1])
def test_condition_durations_must_be_positive(value):
    with pytest.raises(ValueError) as info:
        AutoscalerConfig.from_dict({"condition_durations": {"ttft_high_secs": value}})
    assert "condition_durations.ttft_high_secs" in str(info.value)
