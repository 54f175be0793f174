"""verl conformance: verl-shaped policy classes load by import path without Ray and run in the core;
rollmesh's built-ins decide as verl's formulas do; the context is built as verl's trainer builds it."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types

import pytest

from controller.core import DynamicScheduleContext, EventType, HybridState, StepOutcome
from controller.core.policies import (
    DefaultDynamicSchedulePolicy,
    FixedRatioDynamicSchedulePolicy,
    PolicyHandle,
    create_policy,
    resolve_policy,
)
from controller.core.policies.verl_compat import RayShim
from mesh_runtime import samples
from tests import verl_shaped

from .conftest import LAGGING, build_mesh, report

pytestmark = pytest.mark.timeout(60)


def test_ray_is_not_installed_here():
    # the conformance below runs without Ray; if this ever changes, the stand-in path is untested
    assert importlib.util.find_spec("ray") is None


@pytest.mark.parametrize("path", [verl_shaped.DEFAULT, verl_shaped.FIXED, verl_shaped.STATIC, verl_shaped.MY_POLICY])
def test_verl_classes_load_by_import_path_without_ray(verl_root, path):
    cls = resolve_policy(path)
    assert cls.__module__.startswith("verl.experimental.fully_async_policy.dynamic_schedule")
    assert "ray" not in sys.modules                           # the stand-in lived only during the import
    policy = create_policy(path, deactivate_ratio=0.4, only_hybrid=False)
    bases = {f"{k.__module__}.{k.__qualname__}" for k in type(policy).__mro__}
    assert f"{verl_shaped.PACKAGE}.base.DynamicSchedulePolicyBase" in bases            # verl's ABC ...
    assert "controller.core.policies.base.DynamicSchedulePolicyBase" not in bases      # ... not rollmesh's
    handle = PolicyHandle(policy)
    assert policy._rollouter is handle.rollouter              # injected as verl's controller does
    assert handle.parameters()["deactivate_ratio"] == pytest.approx(0.4)


def test_verl_default_rebalances_the_verl_way_and_the_example_does_not(verl_root):
    ctx = DynamicScheduleContext(required_samples=32, trigger_parameter_sync_step=4)
    verl_default = PolicyHandle(create_policy(verl_shaped.DEFAULT))
    assert verl_default.request_rebalance(1, ctx) == (True, "rollouter")
    # ray.get of the handle's value went through rollmesh's shim, not to a Ray cluster
    assert verl_default.policy.rebalance_results == [{"scheduled": True, "reset_prefix_cache": True}]
    module = sys.modules[type(verl_default.policy).__module__]
    assert isinstance(module.ray, RayShim)
    example = PolicyHandle(create_policy(verl_shaped.MY_POLICY))
    assert example.request_rebalance(1, ctx) == (False, "")
    static = PolicyHandle(create_policy(verl_shaped.STATIC))
    assert static.request_rebalance(1, ctx) == (False, "")   # inherits verl's no-op


def test_ray_shim_delegates_to_a_real_ray_when_one_is_installed(verl_root, tmp_path, monkeypatch):
    fake_ray = types.ModuleType("ray")
    calls = []
    fake_ray.get = lambda refs, **kw: calls.append(refs) or "from real ray"   # type: ignore[attr-defined]
    fake_ray.remote = "real remote"                                            # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    cls = resolve_policy(verl_shaped.DEFAULT)
    shim = sys.modules[cls.__module__].ray
    assert isinstance(shim, RayShim)
    handle = PolicyHandle(cls())
    assert handle.request_rebalance(1, DynamicScheduleContext()) == (True, "rollouter")
    assert calls == []                                         # our value never reaches ray.get
    assert shim.get("other ref") == "from real ray" and calls == ["other ref"]
    assert shim.remote == "real remote"


async def test_verl_default_runs_in_the_controller_core_with_rebalance(verl_root):
    mesh = build_mesh()
    ctrl = mesh.controller(dynamic_schedule_policy=verl_shaped.DEFAULT)
    await ctrl.begin_step(1, report(**LAGGING))
    done = await ctrl.complete_step(1, 1, report(**LAGGING))
    assert done.hybrid_activated and done.rebalanced
    assert mesh.ops(1) == ["sync", "wake", "add", "resume", "clear_sticky", "rebalance"]
    phases = [e for e in mesh.events_of(EventType.STEP_PHASE) if e.attributes.get("phase") == "rebalance"]
    assert phases and phases[-1].attributes["requested"] == "rollouter"
    # verl's update_after_step saw the cycle's accumulated switch time (activation 6 s + rebalance 1 s)
    assert ctrl.policy._overheads == [pytest.approx(7.0)]
    assert ctrl.ctx.last_activate_duration_s == 0.0
    begin = await ctrl.begin_step(2, report(**LAGGING))
    assert begin.deactivate and begin.wait_samples == int(128 * ctrl.policy.deactivate_ratio)
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.released_replica_ids == ("h1", "h2") and ctrl.hybrid_state is HybridState.STANDALONE_ONLY
    state = ctrl.scheduler_state()                             # no rollmesh hooks: parameters by attribute
    assert state.policy_parameters["only_hybrid"] is False and state.deactivate_ratio is not None


async def test_reference_example_activates_without_rebalance(verl_root):
    mesh = build_mesh()
    ctrl = mesh.controller(dynamic_schedule_policy=verl_shaped.MY_POLICY)
    await ctrl.begin_step(1, report(**LAGGING))
    done = await ctrl.complete_step(1, 1, report(**LAGGING))
    assert done.hybrid_activated and not done.rebalanced
    assert "rebalance" not in mesh.ops(1)


# --- decision tables: rollmesh's built-ins against verl's formulas -----------------------------

GRID = list(itertools.product(
    (1, 32, 256),            # required_samples
    (1, 4),                  # trigger_parameter_sync_step
    (0, 1, 3),               # global step -> expected = step_required x step
    (-80, -1, 0, 1, 40, 300),  # generated - expected (surplus)
    (0.0, 0.1, 0.5),         # staleness_threshold -> buffer = step_required x staleness
    (False, True),           # only_hybrid
))


def _verl_default_activates(ratio, ctx, per_sample=1000.0, switch_cost=10.0):
    if ctx.only_hybrid:
        return True
    gap = ratio * ctx.step_required_samples - (ctx.total_generated_samples - ctx.expected_samples)
    return gap > 0 and max(0.0, gap) * per_sample - switch_cost > 0


def _verl_fixed_activates(ratio, ctx):
    return ctx.only_hybrid or (ctx.total_generated_samples - ctx.expected_samples
                               < ratio * ctx.step_required_samples)


def _ctx(required, trigger, step, surplus, staleness, only_hybrid, **extra):
    step_required = samples.step_required_samples(required, trigger)
    expected = samples.expected_samples(step_required, step)
    return DynamicScheduleContext(
        required_samples=required, trigger_parameter_sync_step=trigger, expected_samples=expected,
        total_generated_samples=max(0, expected + surplus), buffer_samples=samples.buffer_samples(step_required,
                                                                                                  staleness),
        only_hybrid=only_hybrid, **extra)


@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.6, 1.0])
def test_default_and_fixed_ratio_decide_as_verls_formulas_over_a_grid(ratio):
    checked = 0
    for required, trigger, step, surplus, staleness, only_hybrid in GRID:
        c = _ctx(required, trigger, step, surplus, staleness, only_hybrid)
        effective = 1.0 if only_hybrid else ratio
        default = DefaultDynamicSchedulePolicy(deactivate_ratio=ratio, only_hybrid=only_hybrid)
        fixed = FixedRatioDynamicSchedulePolicy(deactivate_ratio=ratio, only_hybrid=only_hybrid)
        assert default.should_activate_after_step(step, False, c) is _verl_default_activates(effective, c), c
        assert fixed.should_activate_after_step(step, False, c) is _verl_fixed_activates(effective, c), c
        wait = int(c.step_required_samples * effective)
        assert default.deactivate_wait_samples(c) == wait and fixed.deactivate_wait_samples(c) == wait
        assert default.should_deactivate(step, True, c) is True and default.should_deactivate(step, False, c) is False
        checked += 1
    assert checked == len(GRID) == 648


def test_default_cost_gate_with_a_rate_signal_matches_verl():
    # a real signal: 6 s over 40 waited samples = 0.15 s per sample
    for surplus in range(-100, 60, 7):
        c = _ctx(32, 4, 2, surplus, 0.1, False, step_wait_times=[4.0, 2.0], step_wait_samples=[30, 10])
        p = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3)
        assert p.should_activate_after_step(2, False, c) is _verl_default_activates(0.3, c, per_sample=0.15)


def test_issue_probe_fixed_ratio_activates_as_verl_does():
    # required 256, trigger 4, expected 1024, buffer 512, generated 1600: surplus 576 < 0.6 x 1024 = 614.4
    c = DynamicScheduleContext(required_samples=256, trigger_parameter_sync_step=4, expected_samples=1024,
                               buffer_samples=512, total_generated_samples=1600)
    assert FixedRatioDynamicSchedulePolicy(deactivate_ratio=0.6).should_activate_after_step(1, False, c)
    assert not FixedRatioDynamicSchedulePolicy(deactivate_ratio=0.3).should_activate_after_step(1, False, c)
    # the old rollmesh rule (expected + buffer - generated > 0) said no for both: -64
    assert c.expected_samples + c.buffer_samples - c.total_generated_samples < 0


def test_adaptation_sequence_matches_verl_where_the_ratio_was_used(verl_root):
    """Cycles with and without waits, every cycle using the ratio: the same ratios as verl's rule."""
    verl = create_policy(verl_shaped.DEFAULT, deactivate_ratio=0.3)
    ours = DefaultDynamicSchedulePolicy(deactivate_ratio=0.3)
    waits = [[10, 6], [], [3], [], [], [200], [1], []]
    for step, waited in enumerate(waits, start=1):
        c = _ctx(32, 4, step, -5, 0.1, False, step_wait_samples=waited, step_wait_times=[1.0] * len(waited))
        ours.observe_step(step, StepOutcome(global_step=step, deactivated=True), c)
        verl.update_after_step(step, c)
        ours.update_after_step(step, c)
        assert ours.deactivate_ratio == pytest.approx(verl.deactivate_ratio)
    # rollmesh's fixes: a cycle that did not use the ratio leaves it alone; the floor is 0.05
    before = ours.deactivate_ratio
    c = _ctx(32, 4, 20, -5, 0.1, False)
    ours.observe_step(20, StepOutcome(global_step=20, deactivated=False), c)
    ours.update_after_step(20, c)
    verl.update_after_step(20, c)
    assert ours.deactivate_ratio == before and verl.deactivate_ratio == pytest.approx(before - 0.02)
    for step in range(21, 60):
        c = _ctx(32, 4, step, -5, 0.1, False)
        ours.observe_step(step, StepOutcome(global_step=step, deactivated=True), c)
        ours.update_after_step(step, c)
        verl.update_after_step(step, c)
    assert ours.deactivate_ratio == 0.05 and verl.deactivate_ratio < 0     # verl's unbounded fall


def test_context_arithmetic_is_verls_trainer():
    step_required = samples.step_required_samples(samples.required_samples(256, 1), 4)
    assert step_required == 1024
    assert samples.buffer_samples(step_required, 0.1) == pytest.approx(102.4)     # constant, not cumulative
    assert samples.expected_samples(step_required, 3) == 3072                     # completed_steps = 3
    assert samples.max_required_samples(256, 0.1, 4) == int(256 * 1.1 * 4) == 1126
    assert samples.wait_samples(256, 300) == 0 and samples.wait_samples(256, 100) == 156


async def test_switch_durations_accumulate_within_a_cycle_and_reset_after_update():
    mesh = build_mesh()
    seen = []

    class Recorder(DefaultDynamicSchedulePolicy):
        def update_after_step(self, global_steps, ctx):
            seen.append((global_steps, ctx.last_activate_duration_s, ctx.last_deactivate_duration_s))
            super().update_after_step(global_steps, ctx)

    ctrl = mesh.controller(policy=Recorder(deactivate_ratio=0.3))
    await ctrl.begin_step(1, report(**LAGGING))
    await ctrl.complete_step(1, 1, report(**LAGGING))           # activation 6 s + rebalance 1 s
    await ctrl.begin_step(2, report(**LAGGING))
    await ctrl.release_hybrid(2, 40, 3.0)                        # deactivation 5.5 s
    await ctrl.complete_step(2, 2, report(**LAGGING))            # lagging: activation again, + 7 s
    assert seen == [(1, pytest.approx(7.0), 0.0), (2, pytest.approx(7.0), pytest.approx(5.5))]
    assert (ctrl.ctx.last_activate_duration_s, ctrl.ctx.last_deactivate_duration_s) == (0.0, 0.0)
