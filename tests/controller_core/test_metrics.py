"""Metrics formulas of the reference's section 4, each against a hand computation."""

from __future__ import annotations

import pytest

from controller.core.metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_UTILIZATION,
    ROLLOUTER_IDLE_RATIO,
    STEP_GENERATED_SAMPLES,
    TRAIN_ALLOCATED_TIME,
    TRAIN_COMPUTE_TIME,
    TRAIN_UTILIZATION,
    ConcurrencyPoint,
    CycleMetrics,
    MicroStep,
    hybrid_rollout_fraction,
    resource_utilization,
    rollout_idle_ratio,
    rollout_resource_utilization,
    train_compute_time_s,
    train_resource_utilization,
)

pytestmark = pytest.mark.timeout(60)

M1 = {"reward": 1.0, "old_log_prob": 2.0, "ref": 1.0, "adv": 0.5, "update_actor": 4.0,
      "gen": 30.0, "step": 50.0}                                # compute 8.5 (gen/step are not compute)
M2 = {"update_actor": 3.0, "values": 1.0, "update_critic": 1.0, "step": 20.0}   # compute 5.0


def test_train_utilization_is_a_ratio_of_sums():
    assert train_compute_time_s(M1) == 8.5 and train_compute_time_s(M2) == 5.0
    assert train_compute_time_s({}) == 0.0
    steps = [MicroStep(M1, 10.0), MicroStep(M2, 6.0)]
    assert train_resource_utilization(steps) == pytest.approx(13.5 / 16)   # not mean(0.85, 0.8333)
    assert train_resource_utilization([]) == 0.0


def test_rollout_utilization_with_capacity_changing_mid_window_and_cap_zero():
    # s = 4 samples per replica, maxReq = 10
    history = [(0, 3, 2),    # cap min(8, 10) = 8, 10 s, load min(8, 3) = 3
               (10, 12, 3),  # cap min(12, 10) = 10, 5 s, load 10
               (15, 5, 0),   # cap 0: skipped
               (20, 6, 1),   # cap 4, 10 s, load 4
               (30, 0, 1)]   # closes the window
    used = 10 * 3 + 5 * 10 + 10 * 4
    weight = 10 * 8 + 5 * 10 + 10 * 4
    assert rollout_resource_utilization(history, 4, 10) == pytest.approx(used / weight)
    assert rollout_resource_utilization([(0, 5, 0), (10, 5, 0)], 4, 10) == 0.0
    assert rollout_resource_utilization([(0, 5, 2)], 4, 10) == 0.0
    with pytest.raises(ValueError, match="back in time"):
        rollout_resource_utilization([(5, 1, 1), (4, 1, 1)], 4, 10)


def test_rollout_utilization_with_given_capacity_and_placeholder_seed():
    history = [ConcurrencyPoint(0, 0, capacity=0, placeholder=True),
               ConcurrencyPoint(5, 2, capacity=8),
               ConcurrencyPoint(10, 0, capacity=8)]
    # seed corrected to cap 8: (5*0 + 5*2) / (5*8 + 5*8) = 0.125; uncorrected it would be 10/40
    assert rollout_resource_utilization(history, 4, 100) == pytest.approx(0.125)
    uncorrected = [ConcurrencyPoint(0, 0, capacity=0), *history[1:]]
    assert rollout_resource_utilization(uncorrected, 4, 100) == pytest.approx(0.25)
    # capacity given explicitly is still clamped to maxReq: min(20, 10) = 10, load min(10, 12) = 10
    assert rollout_resource_utilization([ConcurrencyPoint(0, 12, capacity=20), ConcurrencyPoint(1, 0, capacity=20)],
                                        4, 10) == 1.0


def test_resource_utilization_and_x_clipping():
    a, b, ut, ur = 16, 16, 0.8, 0.9
    # x = 30 / 100 = 0.3
    expected = ((1 - 0.3) * 16 * 0.8 + (0.3 * 16 + 16) * 0.9) / 32
    assert resource_utilization(30, 100, a, b, ut, ur) == pytest.approx(expected)
    assert resource_utilization(150, 100, a, b, ut, ur) == pytest.approx(0.9)       # x clipped to 1
    assert resource_utilization(0, 100, a, b, ut, ur) == pytest.approx((16 * 0.8 + 16 * 0.9) / 32)
    assert hybrid_rollout_fraction(10, 0) == 0.0 and hybrid_rollout_fraction(-1, 5) == 0.0
    assert resource_utilization(10, 10, 0, 0, ut, ur) == 0.0


def test_idle_ratio_counts_every_pause_window():
    history = [(0, 0, 1), (2, 5, 1), (6, 0, 1), (7, 3, 1), (10, 3, 1)]
    assert rollout_idle_ratio(history) == pytest.approx(3 / 10)                       # 2 s + 1 s idle


def metrics() -> CycleMetrics:
    return CycleMetrics(hybrid_gpus=8, standalone_gpus=24, concurrent_samples_per_replica=4,
                        max_required_samples=100)


def test_cycle_aggregates_micro_steps_by_sums_and_closes_exactly_at_sync():
    m = metrics()
    m.add_micro_step(timing_raw=M1, allocated_s=10.0, queue_size=7, step_generated_samples=40,
                     rollout_history=[ConcurrencyPoint(0, 4, servers=2), ConcurrencyPoint(10, 8, servers=2)],
                     now=0.0)
    m.record_deactivation_wait(14.0)
    m.add_micro_step(timing_raw=M2, allocated_s=6.0, queue_size=3, step_generated_samples=64,
                     rollout_history=[ConcurrencyPoint(10, 8, servers=2), ConcurrencyPoint(20, 0, servers=2)])
    closed = m.close_cycle(global_step=4, weight_version=1, now=20.0)
    v = closed.values
    assert closed.cycle == 1 and closed.started_at == 0.0 and closed.ended_at == 20.0
    assert v[TRAIN_COMPUTE_TIME] == 13.5 and v[TRAIN_ALLOCATED_TIME] == 16.0
    assert v[TRAIN_UTILIZATION] == pytest.approx(13.5 / 16)
    # caps 8 throughout: (10*4 + 0*8 + 10*8) / (10*8 + 0 + 10*8) = 120 / 160
    assert v[ROLLOUT_UTILIZATION] == pytest.approx(0.75)
    x = 14.0 / 70.0                                          # step = 50 + 20
    assert v[RESOURCE_UTILIZATION] == pytest.approx(((1 - x) * 8 * (13.5 / 16) + (x * 8 + 24) * 0.75) / 32)
    assert v[MQ_SIZE] == 3 and v[STEP_GENERATED_SAMPLES] == 64          # last values, not means
    assert v[ROLLOUTER_IDLE_RATIO] == 0.0
    # the next report opens cycle 2: nothing of cycle 1 leaks in, nothing of it is lost
    m.add_micro_step(timing_raw=M2, allocated_s=5.0, now=21.0)
    second = m.close_cycle(global_step=8, weight_version=2, now=30.0)
    assert second.cycle == 2 and second.started_at == 20.0
    assert second.values[TRAIN_COMPUTE_TIME] == 5.0 and second.values[TRAIN_UTILIZATION] == 1.0
    assert MQ_SIZE not in second.values
    assert [c.cycle for c in m.cycles(from_cycle=2)] == [2]


def test_x_is_zero_without_a_deactivation_wait_this_cycle():
    m = metrics()
    m.add_micro_step(timing_raw={**M1, "wait_for_enough_samples": 30.0}, allocated_s=10.0, compute_s=5.0)
    v = m.close_cycle(global_step=1, weight_version=1, now=1.0).values
    assert v[TRAIN_COMPUTE_TIME] == 5.0                       # the trainer's own compute figure wins
    assert v[RESOURCE_UTILIZATION] == pytest.approx((8 * 0.5 + 24 * 0.0) / 32)


def test_cycle_document_round_trip():
    m = metrics()
    m.add_micro_step(timing_raw=M1, allocated_s=10.0)
    m.close_cycle(global_step=1, weight_version=1, now=1.0)
    restored = metrics()
    restored.restore(m.to_document())
    assert restored.cycles() == m.cycles()
    assert restored.close_cycle(global_step=2, weight_version=2, now=2.0).cycle == 2


def test_cycle_treats_only_the_first_zero_capacity_point_as_the_placeholder_seed():
    m = metrics()   # s = 4, maxReq = 100
    m.add_micro_step(timing_raw={}, allocated_s=1.0, rollout_history=[
        ConcurrencyPoint(0, 0, capacity=0),      # init seed: corrected to 8
        ConcurrencyPoint(5, 2, capacity=8),
        ConcurrencyPoint(10, 3, capacity=0),     # a real zero-capacity interval: skipped
        ConcurrencyPoint(12, 4, capacity=8),
        ConcurrencyPoint(16, 0, capacity=8)])
    v = m.close_cycle(global_step=1, weight_version=1, now=16.0).values
    # used 5*0 + 5*2 + 4*4 = 26; weight 5*8 + 5*8 + 4*8 = 112
    assert v[ROLLOUT_UTILIZATION] == pytest.approx(26 / 112)
    m.add_micro_step(timing_raw={}, allocated_s=1.0, rollout_history=[
        ConcurrencyPoint(16, 0, capacity=0), ConcurrencyPoint(20, 1, capacity=8), ConcurrencyPoint(24, 0)])
    # not a seed any more: the first interval has capacity 0 and is skipped -> 4*1 / 4*8
    assert m.close_cycle(global_step=2, weight_version=2, now=24.0).values[ROLLOUT_UTILIZATION] == 0.125
