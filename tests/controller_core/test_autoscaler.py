"""Hand-computed sequences for the autoscaler decision core (controller/scaling/autoscaler.py)."""

from __future__ import annotations

import dataclasses

import pytest

from controller.scaling.autoscaler import (
    Autoscaler,
    AutoscalerConfig,
    MetricsSample,
    ScaleInPolicy,
    ScaleOutPolicy,
    scale_out_delta,
    throughput_cv2,
)

pytestmark = pytest.mark.timeout(30)

# Neutral defaults: neither any scale-out nor any scale-in condition holds.
NEUTRAL = {"engines": 4, "usage": 0.5, "queue": 5, "qt": 1.0, "ttft": 1.0, "tp": 100.0}


def sample(t: float, **kw) -> MetricsSample:
    v = {**NEUTRAL, **kw}
    return MetricsSample(
        time=t,
        num_engines=v["engines"],
        avg_token_usage=v["usage"],
        total_queue_reqs=v["queue"],
        queue_time_p95=v["qt"],
        ttft_p95=v["ttft"],
        throughput=v["tp"],
    )


def feed(a: Autoscaler, times, **kw) -> None:
    for t in times:
        a.record_metrics(sample(t, **kw))


# ---- config ---------------------------------------------------------------


def test_config_defaults_match_reference():
    c = AutoscalerConfig()
    assert (c.enabled, c.min_engines, c.max_engines) == (True, 1, 32)
    assert (c.scale_out_cooldown_secs, c.scale_in_cooldown_secs) == (60.0, 300.0)
    assert (
        c.metrics_interval_secs,
        c.evaluation_interval_secs,
        c.condition_window_secs,
    ) == (10.0, 30.0, 60.0)
    assert dataclasses.asdict(c.scale_out_policy) == {
        "token_usage_threshold": 0.85,
        "queue_depth_per_engine": 10,
        "queue_time_p95_threshold": 5.0,
        "ttft_p95_threshold": 10.0,
        "condition_duration_secs": 30.0,
        "max_delta": 4,
    }
    assert dataclasses.asdict(c.scale_in_policy) == {
        "token_usage_threshold": 0.3,
        "queue_depth_threshold": 0,
        "throughput_variance_threshold": 0.1,
        "condition_duration_secs": 120.0,
        "max_delta": 1,
        "projected_usage_max": 0.5,
    }
    c.validate()


@pytest.mark.parametrize(
    "cfg, field",
    [
        (AutoscalerConfig(min_engines=5, max_engines=4), "min_engines"),
        (AutoscalerConfig(max_engines=0, min_engines=0), "max_engines"),
        (AutoscalerConfig(scale_in_cooldown_secs=-1), "scale_in_cooldown_secs"),
        (AutoscalerConfig(condition_window_secs=0), "condition_window_secs"),
        (
            AutoscalerConfig(scale_out_policy=ScaleOutPolicy(max_delta=0)),
            "scale_out_policy.max_delta",
        ),
        (
            AutoscalerConfig(scale_in_policy=ScaleInPolicy(projected_usage_max=0)),
            "scale_in_policy.projected_usage_max",
        ),
        (
            AutoscalerConfig(scale_in_policy=ScaleInPolicy(token_usage_threshold=0.9)),
            "scale_in_policy.token_usage_threshold",
        ),
    ],
)
def test_validate_names_field(cfg, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cfg.validate()


def test_from_dict_reference_yaml_shape():
    c = AutoscalerConfig.from_dict(
        {
            "enabled": True,
            "min_engines": 2,
            "max_engines": 16,
            "rollout_service_url": "http://localhost:8000/rollout",
            "scale_out_policy": {"max_delta": 2},
            "scale_in_policy": {"projected_usage_max": 0.4},
        }
    )
    assert (c.min_engines, c.max_engines) == (2, 16)
    assert (
        c.scale_out_policy.max_delta == 2
        and c.scale_out_policy.token_usage_threshold == 0.85
    )
    assert c.scale_in_policy.projected_usage_max == 0.4
    with pytest.raises(ValueError, match="min_engines"):
        AutoscalerConfig.from_dict({"min_engines": 9, "max_engines": 3})


# ---- delta formula ----------------------------------------------------------


@pytest.mark.parametrize(
    "usage, queue, engines, max_delta, expected",
    [
        (0.95, 0, 4, 4, 2),  # int(0.25 / 0.1) = 2
        (0.9, 0, 4, 4, 1),  # not > 0.9 -> usage_delta 0 -> floor of 1
        (0.88, 0, 4, 4, 1),
        (0.5, 100, 4, 4, 4),  # (100 - 20) // 20 = 4
        (0.5, 45, 4, 4, 1),  # (45 - 20) // 20 = 1
        (0.5, 65, 1, 4, 3),  # (65 - 5) // 20 = 3
        (0.5, 200, 4, 4, 4),  # (200 - 20) // 20 = 9, capped at 4
        (0.5, 200, 4, 10, 9),
        (0.95, 65, 1, 4, 3),  # max(2, 3, 1)
        (0.95, 100, 4, 1, 1),
    ],
)
def test_scale_out_delta_formula(usage, queue, engines, max_delta, expected):
    assert scale_out_delta(usage, queue, engines, max_delta) == expected


def test_throughput_cv2():
    assert throughput_cv2([100.0, 100.0]) == 0.0
    assert throughput_cv2([50.0, 150.0]) == pytest.approx(0.25)  # var 2500 / 100^2
    assert throughput_cv2([90.0, 110.0]) == pytest.approx(0.01)
    assert throughput_cv2([0.0, 0.0]) == 0.0


# ---- scale-out conditions -----------------------------------------------------


def test_token_usage_high_alone_triggers_after_30s():
    a = Autoscaler()
    feed(a, [0, 10, 20], usage=0.88)
    d = a.evaluate(20, False)
    assert d.action == "none"
    a.record_metrics(sample(30, usage=0.88))
    d = a.evaluate(30, False)
    assert d.action == "scale_out"
    assert d.triggered_conditions == ("token_usage_high",)
    assert d.delta == 1  # usage 0.88 <= 0.9, queue 5 < 20
    assert d.reason == "Conditions met: token_usage_high"
    assert d.metrics_snapshot["avg_token_usage"] == 0.88


def test_flickering_condition_does_not_trigger():
    a = Autoscaler()
    feed(a, [0, 10, 20], usage=0.88)
    a.record_metrics(sample(30, usage=0.5))  # breaks the run
    feed(a, [40, 50, 60], usage=0.88)
    assert a.conditions(60)["token_usage_high"].held_for == 20
    assert a.evaluate(60, False).action == "none"
    a.record_metrics(sample(70, usage=0.88))
    assert a.evaluate(70, False).action == "scale_out"


def test_alternating_condition_never_triggers():
    a = Autoscaler()
    for i in range(20):
        a.record_metrics(sample(i * 10, usage=0.9 if i % 2 == 0 else 0.8))
        assert a.evaluate(i * 10, False).action == "none"


def test_queue_backlog_alone_triggers_after_20s():
    a = Autoscaler()
    feed(a, [0, 10], queue=41)  # > 10 x 4
    assert a.evaluate(10, False).action == "none"
    a.record_metrics(sample(20, queue=41))
    d = a.evaluate(20, False)
    assert (d.action, d.triggered_conditions, d.delta) == (
        "scale_out",
        ("queue_backlog",),
        1,
    )  # (41-20)//20


def test_queue_backlog_at_threshold_does_not_hold():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], queue=40)
    assert a.evaluate(30, False).action == "none"


def test_queue_latency_high_alone_triggers_after_15s():
    a = Autoscaler()
    feed(a, [0, 10], qt=6.0)
    assert a.evaluate(10, False).action == "none"
    a.record_metrics(sample(15, qt=6.0))
    d = a.evaluate(15, False)
    assert (d.action, d.triggered_conditions, d.delta) == (
        "scale_out",
        ("queue_latency_high",),
        1,
    )


def test_ttft_high_alone_triggers_after_15s():
    a = Autoscaler()
    feed(a, [0, 10], ttft=10.5)
    assert a.evaluate(10, False).action == "none"
    a.record_metrics(sample(15, ttft=10.5))
    d = a.evaluate(15, False)
    assert (d.action, d.triggered_conditions) == ("scale_out", ("ttft_high",))


def test_combined_conditions_delta_and_reason():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95, queue=100)
    d = a.evaluate(30, False)
    assert d.action == "scale_out"
    assert d.triggered_conditions == ("token_usage_high", "queue_backlog")
    assert d.reason == "Conditions met: token_usage_high, queue_backlog"
    assert d.delta == 4  # max(2, 4, 1) capped at 4


def test_usage_delta_through_evaluate():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95)
    assert a.evaluate(30, False).delta == 2


def test_scale_out_capped_by_max_engines():
    a = Autoscaler(AutoscalerConfig(max_engines=6))
    feed(a, [0, 10, 20], queue=200)
    d = a.evaluate(20, False)
    assert (d.action, d.delta) == ("scale_out", 2)  # formula 4, headroom 6 - 4


def test_no_scale_out_at_max_engines():
    a = Autoscaler(AutoscalerConfig(max_engines=4))
    feed(a, [0, 10, 20], queue=200)
    d = a.evaluate(20, False)
    assert d.action == "none" and "max_engines" in d.reason
    assert d.triggered_conditions == ("queue_backlog",)


# ---- gating -------------------------------------------------------------------


def test_pending_operation_blocks_decision():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95)
    d = a.evaluate(30, True)
    assert d.action == "none" and "pending" in d.reason
    assert a.evaluate(30, False).action == "scale_out"


def test_scale_out_cooldown_60s_and_runs_restart():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95)
    assert a.evaluate(30, False).action == "scale_out"
    a.record_scale("scale_out", 30)
    feed(a, [40, 50, 60, 70, 80], usage=0.95)  # run restarts at 40
    d = a.evaluate(80, False)
    assert d.action == "none" and "cooldown" in d.reason  # 50 s < 60 s
    a.record_metrics(sample(90, usage=0.95))
    d = a.evaluate(90, False)
    assert d.action == "scale_out"  # cooldown over, held 90 - 40 = 50 >= 30


def test_record_scale_restarts_condition_runs():
    a = Autoscaler(AutoscalerConfig(scale_out_cooldown_secs=0))
    feed(a, [0, 10, 20, 30], usage=0.95)
    a.record_scale("scale_out", 30)
    a.record_metrics(sample(40, usage=0.95))
    assert a.evaluate(40, False).action == "none"
    feed(a, [50, 60, 70], usage=0.95)
    assert a.evaluate(70, False).action == "scale_out"


def test_scale_in_cooldown_300s():
    a = Autoscaler()
    a.record_scale("scale_in", 0)
    feed(a, [260, 270, 280, 290], usage=0.95)
    d = a.evaluate(299, False)
    assert d.action == "none" and "cooldown" in d.reason
    a.record_metrics(sample(300, usage=0.95))
    assert a.evaluate(300, False).action == "scale_out"


def test_record_scale_rejects_unknown_action():
    with pytest.raises(ValueError, match="action"):
        Autoscaler().record_scale("grow", 0)


def test_too_few_engines_reporting():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95, engines=4)
    d = a.evaluate(30, False, current_engines=5)
    assert d.action == "none" and "4/5" in d.reason
    assert a.evaluate(30, False, current_engines=4).action == "scale_out"


def test_stale_or_missing_metrics():
    a = Autoscaler()
    assert a.evaluate(0, False).action == "none"
    feed(a, [0, 10, 20, 30], usage=0.95)
    d = a.evaluate(91, False)  # latest sample 61 s old > 60 s window
    assert d.action == "none" and "metrics" in d.reason


def test_disabled():
    a = Autoscaler(AutoscalerConfig(enabled=False))
    feed(a, [0, 10, 20, 30], usage=0.95)
    assert a.evaluate(30, False).action == "none"
    a.enabled = True
    assert a.evaluate(30, False).action == "scale_out"


def test_samples_must_not_go_backwards():
    a = Autoscaler()
    a.record_metrics(sample(10))
    with pytest.raises(ValueError, match="time"):
        a.record_metrics(sample(5))


def test_window_keeps_condition_window():
    a = Autoscaler()
    feed(a, range(0, 130, 10))
    assert [s.time for s in a.samples()] == [60, 70, 80, 90, 100, 110, 120]


# ---- scale-in -------------------------------------------------------------------

IDLE = {"usage": 0.1, "queue": 0, "tp": 100.0}


def test_scale_in_after_120s_all_conditions():
    a = Autoscaler()
    feed(a, range(0, 120, 10), **IDLE)
    d = a.evaluate(110, False)
    assert d.action == "none"  # token_usage_low / no_queue held 110 s < 120 s
    a.record_metrics(sample(120, **IDLE))
    d = a.evaluate(120, False)
    assert d.action == "scale_in" and d.delta == 1  # projected 0.1 * 4 / 3 = 0.133
    assert d.triggered_conditions == (
        "token_usage_low",
        "no_queue",
        "throughput_stable",
    )
    assert d.reason == "Conditions met: token_usage_low, no_queue, throughput_stable"


def test_scale_in_needs_no_queue():
    a = Autoscaler()
    feed(a, range(0, 200, 10), usage=0.1, queue=1, tp=100.0)
    c = a.conditions(190)
    assert c["token_usage_low"].triggered and c["throughput_stable"].triggered
    assert not c["no_queue"].triggered
    assert a.evaluate(190, False).action == "none"


def test_scale_in_queue_blip_restarts_run():
    a = Autoscaler()
    feed(a, range(0, 100, 10), **IDLE)
    a.record_metrics(sample(100, usage=0.1, queue=2, tp=100.0))
    feed(a, range(110, 230, 10), **IDLE)
    assert a.evaluate(220, False).action == "none"  # no_queue held 110 s
    a.record_metrics(sample(230, **IDLE))
    assert a.evaluate(230, False).action == "scale_in"


def test_scale_in_needs_low_usage():
    a = Autoscaler()
    feed(a, range(0, 200, 10), usage=0.3, queue=0, tp=100.0)  # not < 0.3
    assert a.evaluate(190, False).action == "none"


def test_scale_in_needs_stable_throughput():
    a = Autoscaler()
    for i, t in enumerate(range(0, 200, 10)):
        a.record_metrics(sample(t, usage=0.1, queue=0, tp=50.0 if i % 2 else 150.0))
    c = a.conditions(190)
    assert not c["throughput_stable"].triggered
    assert c["throughput_stable"].value == pytest.approx(
        throughput_cv2([50, 150, 50, 150, 50, 150, 50])
    )
    assert a.evaluate(190, False).action == "none"
    b = Autoscaler()
    for i, t in enumerate(range(0, 130, 10)):
        b.record_metrics(sample(t, usage=0.1, queue=0, tp=90.0 if i % 2 else 110.0))
    assert b.evaluate(120, False).action == "scale_in"


def test_scale_in_projected_usage_must_stay_below_half():
    a = Autoscaler()
    feed(a, range(0, 130, 10), usage=0.29, queue=0, tp=100.0, engines=2)
    d = a.evaluate(120, False)
    assert d.action == "none" and "Projected usage 0.580" in d.reason  # 0.29 * 2 / 1
    b = Autoscaler()
    feed(b, range(0, 130, 10), usage=0.29, queue=0, tp=100.0, engines=4)
    assert b.evaluate(120, False).action == "scale_in"  # 0.29 * 4 / 3 = 0.387


def test_scale_in_respects_min_engines():
    a = Autoscaler(AutoscalerConfig(min_engines=4))
    feed(a, range(0, 130, 10), **IDLE)
    d = a.evaluate(120, False)
    assert d.action == "none" and "min_engines" in d.reason


def test_scale_in_delta_bounded_by_max_delta_and_min_engines():
    cfg = AutoscalerConfig(min_engines=3, scale_in_policy=ScaleInPolicy(max_delta=4))
    a = Autoscaler(cfg)
    feed(a, range(0, 130, 10), usage=0.1, queue=0, tp=100.0, engines=5)
    assert a.evaluate(120, False).delta == 2  # 5 - 3; projected 0.1 * 5 / 3 = 0.167
    b = Autoscaler(AutoscalerConfig(scale_in_policy=ScaleInPolicy(max_delta=4)))
    feed(b, range(0, 130, 10), usage=0.2, queue=0, tp=100.0, engines=5)
    # d=4: 1.0/1 = 1.0, d=3: 1.0/2 = 0.5 (not < 0.5), d=2: 1.0/3 = 0.333 -> 2
    assert b.evaluate(120, False).delta == 2


def test_scale_out_takes_precedence_over_scale_in():
    a = Autoscaler()
    feed(a, range(0, 130, 10), usage=0.1, queue=0, tp=100.0, ttft=20.0)
    d = a.evaluate(120, False)
    assert (d.action, d.triggered_conditions) == ("scale_out", ("ttft_high",))


# ---- conditions view ----------------------------------------------------------------


def test_conditions_report():
    a = Autoscaler()
    feed(a, [0, 10], queue=41, usage=0.88)
    c = a.conditions(10)
    assert set(c) == {
        "token_usage_high",
        "queue_backlog",
        "queue_latency_high",
        "ttft_high",
        "token_usage_low",
        "no_queue",
        "throughput_stable",
    }
    qb = c["queue_backlog"]
    assert (
        qb.type,
        qb.triggered,
        qb.held_for,
        qb.required_for,
        qb.value,
        qb.threshold,
    ) == (
        "scale_out",
        False,
        10,
        20.0,
        41.0,
        40.0,
    )
    tu = c["token_usage_high"]
    assert (tu.held_for, tu.required_for, tu.value, tu.threshold) == (
        10,
        30.0,
        0.88,
        0.85,
    )
    assert (
        c["token_usage_low"].type == "scale_in" and c["token_usage_low"].held_for == 0.0
    )
    assert c["throughput_stable"].required_for == 60.0
    a.record_metrics(sample(20, queue=41, usage=0.88))
    assert a.conditions(20)["queue_backlog"].triggered
    assert not a.conditions(81)["queue_backlog"].triggered  # stale


def test_conditions_without_samples():
    c = Autoscaler().conditions(0)
    assert not any(s.triggered for s in c.values())
    assert (
        c["token_usage_high"].value is None and c["token_usage_high"].threshold == 0.85
    )


def test_last_decision_kept():
    a = Autoscaler()
    feed(a, [0, 10, 20, 30], usage=0.95)
    d = a.evaluate(30, False)
    assert a.last_decision is d
