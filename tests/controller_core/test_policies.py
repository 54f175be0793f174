"""Policies: adaptive ratio by hand, clamps, "used" gating, gate, registry and import paths."""

from __future__ import annotations

import dataclasses

import pytest

from controller.core import DynamicScheduleContext, PolicyError, StepOutcome
from controller.core.policies import (
    DefaultDynamicSchedulePolicy,
    DynamicSchedulePolicyBase,
    FixedRatioDynamicSchedulePolicy,
    StaticFullyAsyncPolicy,
    create_policy,
    register_policy,
    registered_policies,
    resolve_policy,
)

pytestmark = pytest.mark.timeout(60)


def ctx(**fields) -> DynamicScheduleContext:
    base = {"required_samples": 32, "trigger_parameter_sync_step": 4}
    base.update(fields)
    return DynamicScheduleContext(**base)


def run_cycle(policy, step, *, used, wait_samples=(), wait_times=None, **ctx_fields):
    """One step as the controller drives it: observe -> activate? -> update."""
    wait_times = list(wait_times) if wait_times is not None else [1.0] * len(wait_samples)
    c = ctx(step_wait_samples=list(wait_samples), step_wait_times=wait_times, **ctx_fields)
    policy.observe_step(step, StepOutcome(global_step=step, deactivated=used), c)
    decision = policy.should_activate_after_step(step, False, c)
    policy.update_after_step(step, c)
    return decision


# --- context ---

def test_context_has_exactly_the_reference_fields_and_derived_step_required():
    names = [f.name for f in dataclasses.fields(DynamicScheduleContext)]
    assert names == ["required_samples", "trigger_parameter_sync_step", "total_generated_samples",
                     "expected_samples", "buffer_samples", "step_wait_times", "step_wait_samples",
                     "only_hybrid", "last_activate_duration_s", "last_deactivate_duration_s"]
    c = ctx()
    assert c.step_required_samples == 128
    c.required_samples = 10
    assert c.step_required_samples == 40
    c.step_wait_times, c.step_wait_samples, c.buffer_samples = [0.5, 2.0], [3, 4], 12.5
    assert DynamicScheduleContext.from_document(c.to_document()) == c


# --- default: adaptive ratio ---

def test_adaptive_ratio_hand_computed_sequence():
    p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3)
    # step_required_samples = 32 * 4 = 128
    run_cycle(p, 1, used=True, wait_samples=[10, 6])      # 16/128 = 0.125 -> clipped to 0.1
    assert p.deactivate_ratio == pytest.approx(0.4)
    run_cycle(p, 2, used=True, wait_samples=[3])          # 3/128 = 0.0234375
    assert p.deactivate_ratio == pytest.approx(0.4234375)
    run_cycle(p, 3, used=True, wait_samples=[])           # no waits: -0.02
    assert p.deactivate_ratio == pytest.approx(0.4034375)
    run_cycle(p, 4, used=False, wait_samples=[50])        # ratio not used: unchanged
    assert p.deactivate_ratio == pytest.approx(0.4034375)
    run_cycle(p, 5, used=True, wait_samples=[1])          # 1/128 -> clipped up to 0.02
    assert p.deactivate_ratio == pytest.approx(0.4234375)
    # wait threshold: int(ratio x required x trigger) = int(0.4234375 * 128) = int(54.2) = 54
    assert p.deactivate_wait_samples(ctx()) == 54


def test_wait_threshold_is_verls_int_of_step_required_times_ratio():
    p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3)
    assert p.deactivate_wait_samples(ctx(required_samples=100, trigger_parameter_sync_step=1)) == 30
    assert p.deactivate_wait_samples(ctx()) == int(128 * 0.3) == 38        # step_required 128 x 0.3 = 38.4
    run_cycle(p, 1, used=True, wait_samples=[])           # 0.28
    run_cycle(p, 2, used=True, wait_samples=[1])          # +0.02 (1/128 clipped up)
    assert p.deactivate_ratio == pytest.approx(0.3)
    assert p.deactivate_wait_samples(ctx()) == int(128 * p.deactivate_ratio)


def test_ratio_clamped_at_both_ends():
    low = DefaultDynamicSchedulePolicy(deactivate_ratio=0.06)
    for step in range(1, 6):
        run_cycle(low, step, used=True)
    assert low.deactivate_ratio == 0.05                   # 0.06 -> 0.04 clamped, then stays
    high = DefaultDynamicSchedulePolicy(deactivate_ratio=0.95)
    for step in range(1, 4):
        run_cycle(high, step, used=True, wait_samples=[128])
    assert high.deactivate_ratio == 1.0
    custom = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3, min_ratio=0.2, max_ratio=0.5)
    for step in range(1, 10):
        run_cycle(custom, step, used=True)
    assert custom.deactivate_ratio == 0.2
    for step in range(10, 20):
        run_cycle(custom, step, used=True, wait_samples=[100])
    assert custom.deactivate_ratio == 0.5


def test_ratio_out_of_range_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"deactivate_ratio=0.01 is outside \[0.05, 1.0\]"):
        DefaultDynamicSchedulePolicy(deactivate_ratio=0.01)
    with pytest.raises(PolicyError, match="min_ratio"):
        DefaultDynamicSchedulePolicy(min_ratio=0.6, max_ratio=0.5)


def test_no_adaptation_without_use_even_over_many_idle_cycles():
    p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3)
    for step in range(1, 50):
        run_cycle(p, step, used=False)
    assert p.deactivate_ratio == 0.3
    # update without any observation for that step: also skipped
    p.update_after_step(99, ctx())
    assert p.deactivate_ratio == 0.3
    assert "skipped" in p.last_adaptation


def test_only_hybrid_forces_ratio_one_and_disables_adaptation():
    p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3, only_hybrid=True)
    assert p.deactivate_ratio == 1.0                      # verl: "only_hybrid=True: forcing deactivate_ratio=1.0"
    run_cycle(p, 1, used=True, wait_samples=[40])
    run_cycle(p, 2, used=True)
    assert p.deactivate_ratio == 1.0 and p.deactivate_wait_samples(ctx()) == 128
    assert p.switch_cost_history == []


# --- default: activation gate ---

def test_gate_without_history_uses_10s_cost_and_1000s_per_sample():
    p = DefaultDynamicSchedulePolicy()                    # ratio 0.3: threshold 0.3 x 128 = 38.4
    assert p.switch_cost_s == 10.0 and p.per_sample_time_s == 1000.0
    c = ctx(expected_samples=100, buffer_samples=10, total_generated_samples=138)   # gap 38.4 - 38 = 0.4
    assert p.should_activate_after_step(1, False, c) is True     # 0.4 * 1000 > 10
    c = ctx(expected_samples=100, buffer_samples=10, total_generated_samples=139)   # gap -0.6
    assert p.should_activate_after_step(2, False, c) is False
    c = ctx(expected_samples=100, buffer_samples=0, total_generated_samples=50)     # gap 88.4: buffer unused
    assert p.should_activate_after_step(3, False, c) is True


def test_gate_with_rate_signal_and_rolling_three_average():
    p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.25)   # threshold 0.25 x 128 = 32
    waits = {"step_wait_times": [2.0, 1.0], "step_wait_samples": [30, 20]}   # 3 s / 50 = 0.06 s per sample
    c = ctx(expected_samples=100, total_generated_samples=122, **waits)       # gap 32 - 22 = 10
    p.observe_step(1, StepOutcome(global_step=1), c)
    assert p.per_sample_time_s == pytest.approx(0.06)
    assert p.should_activate_after_step(1, False, c) is False     # 10 * 0.06 = 0.6 < 10
    c = ctx(expected_samples=300, total_generated_samples=100)    # gap 232 -> 13.92 s
    assert p.should_activate_after_step(2, False, c) is True      # estimate kept: no signal this step
    # verl: update_after_step records last_activate + last_deactivate (the cycle's sums) when > 0
    for step, (act, deact) in enumerate([(2.0, 1.0), (0.0, 0.0), (4.0, 2.0), (5.0, 4.0), (1.0, 2.0)], start=3):
        p.update_after_step(step, ctx(last_activate_duration_s=act, last_deactivate_duration_s=deact))
    assert p.switch_cost_history == [6.0, 9.0, 3.0]
    assert p.switch_cost_s == pytest.approx(6.0)                  # mean of the last 3
    assert p.deactivate_ratio == 0.25                             # ratio not used on those cycles
    gap_100 = ctx(expected_samples=68, total_generated_samples=0)   # gap 100: 100 * 0.06 = 6.0, not > 6
    assert p.should_activate_after_step(10, False, gap_100) is False
    gap_101 = ctx(expected_samples=69, total_generated_samples=0)   # 6.06 > 6
    assert p.should_activate_after_step(11, False, gap_101) is True


def test_estimates_refresh_every_step_even_without_a_gap():
    p = DefaultDynamicSchedulePolicy()
    no_gap = ctx(expected_samples=10, total_generated_samples=500, step_wait_times=[8.0], step_wait_samples=[4])
    p.observe_step(1, StepOutcome(global_step=1), no_gap)
    assert p.should_activate_after_step(1, False, no_gap) is False
    assert p.per_sample_time_s == pytest.approx(2.0) and p.has_rate_signal
    p.observe_step(2, StepOutcome(global_step=2), ctx(step_wait_times=[0.0], step_wait_samples=[0]))
    assert p.per_sample_time_s == pytest.approx(2.0)              # no signal: estimate kept


def test_gate_refreshes_rate_when_driven_with_reference_calls_only():
    p = DefaultDynamicSchedulePolicy()
    c = ctx(expected_samples=100, total_generated_samples=99, step_wait_times=[1.0], step_wait_samples=[100])
    assert p.should_activate_after_step(1, False, c) is False     # 1 * 0.01 < 10, with this step's rate
    assert p.per_sample_time_s == pytest.approx(0.01)


def test_only_hybrid_always_activates():
    p = DefaultDynamicSchedulePolicy(only_hybrid=True)
    assert p.should_activate_after_step(1, False, ctx(expected_samples=10, total_generated_samples=9)) is True
    assert p.should_activate_after_step(2, False, ctx(expected_samples=9, total_generated_samples=10**6)) is True


def test_default_deactivates_whenever_active_and_requests_rebalance():
    p = DefaultDynamicSchedulePolicy()
    assert p.should_deactivate(1, True, ctx()) is True
    assert p.should_deactivate(1, False, ctx()) is False
    assert p.request_rebalance(1, ctx()) is True


def test_default_state_dict_round_trip():
    p = DefaultDynamicSchedulePolicy()
    run_cycle(p, 1, used=True, wait_samples=[10], wait_times=[5.0])   # ratio 0.3 + 10/128
    p.update_after_step(2, ctx(last_activate_duration_s=3, last_deactivate_duration_s=1))
    q = DefaultDynamicSchedulePolicy()
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict()
    # per-sample 5 s / 10 = 0.5; switch-cost history [3 + 1] -> mean 4
    assert (q.deactivate_ratio, q.per_sample_time_s, q.switch_cost_s) == (p.deactivate_ratio, 0.5, 4.0)
    assert p.deactivate_ratio == pytest.approx(0.3 + 10 / 128)


# --- static and fixed ratio ---

def test_static_fully_async():
    p = create_policy("static_fully_async", deactivate_ratio=0.7)
    assert isinstance(p, StaticFullyAsyncPolicy)
    assert p.should_deactivate(1, True, ctx()) is True and p.should_deactivate(1, False, ctx()) is False
    assert p.deactivate_wait_samples(ctx()) == 0
    assert p.should_activate_after_step(1, False, ctx(expected_samples=10**6)) is False
    p.update_after_step(1, ctx())
    assert p.deactivate_ratio == 0.7 and p.request_rebalance(1, ctx()) is None


def test_fixed_ratio_is_registered_by_default_and_never_adapts():
    assert registered_policies()["fixed_ratio"] is FixedRatioDynamicSchedulePolicy
    p = create_policy("fixed_ratio", deactivate_ratio=0.0)
    assert p.deactivate_wait_samples(ctx()) == 0
    p = create_policy("fixed_ratio", deactivate_ratio=0.6)
    for step in range(1, 5):
        run_cycle(p, step, used=True, wait_samples=[64] if step % 2 else [])
    assert p.deactivate_ratio == 0.6
    assert p.deactivate_wait_samples(ctx()) == int(128 * 0.6) == 76
    # verl's pure check: generated - expected < ratio x step_required (76.8); no cost gate
    c = ctx(expected_samples=10, total_generated_samples=86, step_wait_times=[0.001], step_wait_samples=[100])
    p.observe_step(9, StepOutcome(global_step=9, deactivated=True, deactivate_duration_s=500), c)
    assert p.should_activate_after_step(9, False, c) is True          # surplus 76 < 76.8
    assert p.should_activate_after_step(10, False, ctx(expected_samples=10, total_generated_samples=87)) is False
    only = create_policy("fixed_ratio", deactivate_ratio=0.6, only_hybrid=True)
    assert only.deactivate_ratio == 1.0
    assert only.should_activate_after_step(1, False, ctx(total_generated_samples=10**6)) is True


# --- registry and import paths ---

def test_registry_resolves_names_and_import_paths():
    assert resolve_policy("default") is DefaultDynamicSchedulePolicy
    cls = resolve_policy("tests.controller_core.custom_policy_module:TinyPolicy")
    assert cls.__name__ == "TinyPolicy"
    p = create_policy("tests.controller_core.custom_policy_module:TinyPolicy", deactivate_ratio=0.2, wait=11)
    assert p.deactivate_wait_samples(ctx()) == 11 and p.deactivate_ratio == 0.2


@pytest.mark.parametrize("value, message", [
    ("nope", r"unknown dynamic_schedule_policy 'nope'; registered policies: .*default.*fixed_ratio"),
    ("no_such_pkg.mod:Cls", r"cannot import module 'no_such_pkg.mod' of dynamic_schedule_policy"),
    ("tests.controller_core.custom_policy_module:Missing", r"has no attribute 'Missing'"),
    ("tests.controller_core.custom_policy_module:NotAPolicy",
     r"is not a scheduling policy: it lacks should_deactivate, deactivate_wait_samples, should_activate_after_step"),
    (":Cls", r"not of the form 'package.module:Class'"),
    ("", r"must be a policy name"),
])
def test_registry_errors_name_the_value(value, message):
    with pytest.raises(PolicyError, match=message):
        resolve_policy(value)


def test_create_policy_with_unknown_parameter_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"cannot create dynamic_schedule_policy 'static_fully_async'.*bogus"):
        create_policy("static_fully_async", bogus=1)


def test_register_policy_rejects_conflicts_and_non_policies():
    @register_policy("test_only_policy")
    class First(StaticFullyAsyncPolicy):
        pass

    with pytest.raises(PolicyError, match="already registered"):
        @register_policy("test_only_policy")
        class Second(StaticFullyAsyncPolicy):
            pass

    with pytest.raises(PolicyError, match="is not a scheduling policy: it lacks should_deactivate"):
        register_policy("not_a_policy")(object)
    with pytest.raises(PolicyError, match="is 3, not a class"):
        register_policy("not_a_class")(3)
    assert issubclass(resolve_policy("test_only_policy"), DynamicSchedulePolicyBase)


def test_reference_example_registers_by_name():
    from tests.controller_core.reference_policy import MyDynamicSchedulePolicy

    p = create_policy("my_policy", deactivate_ratio=0.25)
    assert isinstance(p, MyDynamicSchedulePolicy)
    assert p.deactivate_wait_samples(ctx()) == 32
    assert p.state_dict() == {"deactivate_ratio": 0.25}
