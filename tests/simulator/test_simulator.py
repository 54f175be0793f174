"""The simulator drives the real controller core: decisions, determinism, bottlenecks, a hand-computed timeline."""

from __future__ import annotations

import copy

import pytest

from controller.core.hybrid import DynamicResourceController
from controller.core.policies import DefaultDynamicSchedulePolicy, StepOutcome
from simulator.report import bottleneck
from simulator.run import simulate_run
from simulator.scenario import load_scenario, parse_scenario

pytestmark = pytest.mark.timeout(120)


class RecordingDefault(DefaultDynamicSchedulePolicy):
    """The real ``default`` policy, recording every call with a copy of the context it saw."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, tuple, dict, object]] = []

    def _rec(self, name, args, ctx, result):
        self.calls.append((name, copy.deepcopy(args), copy.deepcopy(ctx), result))
        return result

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return self._rec("should_deactivate", (global_steps, is_hybrid_active), ctx,
                         super().should_deactivate(global_steps, is_hybrid_active, ctx))

    def deactivate_wait_samples(self, ctx):
        return self._rec("deactivate_wait_samples", (), ctx, super().deactivate_wait_samples(ctx))

    def observe_step(self, global_steps, outcome, ctx):
        return self._rec("observe_step", (global_steps, outcome), ctx, super().observe_step(global_steps, outcome, ctx))

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return self._rec("should_activate_after_step", (global_steps, is_hybrid_active), ctx,
                         super().should_activate_after_step(global_steps, is_hybrid_active, ctx))

    def request_rebalance(self, global_steps, ctx):
        return self._rec("request_rebalance", (global_steps,), ctx, super().request_rebalance(global_steps, ctx))

    def update_after_step(self, global_steps, ctx):
        return self._rec("update_after_step", (global_steps,), ctx, super().update_after_step(global_steps, ctx))


@pytest.fixture(scope="module")
def tiny():
    return load_scenario("tiny")


def test_policy_decisions_in_the_simulator_equal_the_policy_fed_the_same_context(tiny):
    spec = tiny.run("dynamic")
    policy = RecordingDefault(deactivate_ratio=0.6)
    result = simulate_run(tiny, spec, steps=12, policy_instance=policy)
    assert isinstance(result.controller, DynamicResourceController)
    assert result.controller.policy is policy
    names = [c[0] for c in policy.calls]
    assert "deactivate_wait_samples" in names and "request_rebalance" in names

    # the same policy class fed the same contexts directly, in the same order, decides the same
    fresh = DefaultDynamicSchedulePolicy(deactivate_ratio=0.6)
    for name, args, seen, decided in policy.calls:
        ctx = copy.deepcopy(seen)
        direct = getattr(fresh, name)(*args, ctx) if args else getattr(fresh, name)(ctx)
        assert direct == decided, (name, args)

    # and the simulated trainer did what the decisions said
    by_step = {}
    for name, args, _ctx, decided in policy.calls:
        if args and isinstance(args[0], int):
            by_step.setdefault(args[0], {})[name] = decided
    waits = [c[3] for c in policy.calls if c[0] == "deactivate_wait_samples"]
    assert [s.wait_samples for s in result.steps if s.deactivated] == waits
    for record in result.steps:
        decided = by_step[record.step]
        assert record.deactivated == decided["should_deactivate"]
        # default releases serving hybrids at every begin, so they sleep at every completion
        assert record.activated == decided["should_activate_after_step"]
    # the outcome the core reported about a deactivation carries the wait the trainer really did
    outcomes = [c[1][1] for c in policy.calls if c[0] == "observe_step"]
    assert all(isinstance(o, StepOutcome) for o in outcomes)
    for record, outcome in zip(result.steps, outcomes):
        assert outcome.deactivated == record.deactivated
        if record.deactivated:
            assert outcome.waited_s == pytest.approx(record.waited_s)
            assert outcome.buffered_samples >= record.wait_samples


def test_policy_by_name_and_by_import_path_run_through_the_core(tiny):
    spec = tiny.run("dynamic")
    for policy in ("static_fully_async", "fixed_ratio", "balanced",
                   "tests.controller_core.reference_policy:MyDynamicSchedulePolicy",
                   "simulator.example_policy:ReferenceStylePolicy"):
        result = simulate_run(tiny, spec, steps=6, policy=policy)
        assert result.policy == policy
        assert type(result.controller.policy).__name__ != "RecordingDefault"
        if policy == "static_fully_async":
            assert result.activations == 0
        elif policy == "balanced":     # verl's cost gate keeps tiny's hybrids asleep; the gap was computed
            assert result.controller.policy.last_gap is not None
        else:
            assert result.activations >= 1


def test_same_seed_same_run_other_seed_other_run(tiny):
    spec = tiny.run("dynamic")
    a = simulate_run(tiny, spec, steps=10).to_dict()
    b = simulate_run(tiny, spec, steps=10).to_dict()
    c = simulate_run(tiny, spec, steps=10, seed=tiny.seed + 1).to_dict()
    assert a == b
    assert a["total_time_s"] != c["total_time_s"]


def test_reference_scenario_shows_the_documented_bottlenecks_and_dynamic_beats_both():
    scenario = load_scenario("reference-32gpu")
    results = {spec.name: simulate_run(scenario, spec, steps=30) for spec in scenario.runs}
    required = scenario.workload.required_samples
    low, high, dyn = results["16-16-static"], results["24-8-static"], results["dynamic"]
    assert bottleneck(low, required) == "production (rollout)"
    assert bottleneck(high, required) == "consumption (trainer)"
    # 16+16: the queue after a fit step never holds a mini-batch; 8+24: it sits at its cap
    assert max(s.mq_size for s in low.steps[3:]) < required
    assert min(s.mq_size for s in high.steps[3:]) >= 0.9 * high.queue_cap
    assert low.mean("train_utilization", 3) < 0.7 < high.mean("train_utilization", 3)
    assert high.mean("rollout_utilization", 3) < 0.8 < low.mean("rollout_utilization", 3)
    assert dyn.total_time_s < high.total_time_s < low.total_time_s
    assert dyn.mean("resource_utilization", 3) > max(low.mean("resource_utilization", 3),
                                                     high.mean("resource_utilization", 3))
    assert dyn.activations >= 25 and dyn.dropped == 0


# --- a timeline computed by hand ------------------------------------------------------------------

HAND = {
    "name": "hand", "seed": 1, "steps": 3,
    "cluster": {"total_gpus": 8, "gpus_per_node": 4},
    # one sample per mini-batch, one mini-batch per step, no staleness headroom
    "workload": {"n": 1, "ppo_mini_batch_size": 1, "trigger_parameter_sync_step": 1, "staleness_threshold": 0.0,
                 "prompt_tokens": 0,
                 "response_lengths": {"median": 100, "sigma": 0.0, "max_tokens": 1000, "growth_per_step": 0.0}},
    # one request alone on a replica decodes at 100 tokens/s: every sample takes exactly 1 s
    "engine": {"gpus_per_replica": 4, "peak_tokens_per_s": 100.0, "half_saturation_concurrency": 0.0,
               "concurrent_samples_per_replica": 1},
    # 0.5 s + 100 tokens / 1e6 x 20000 GPU-s per Mtoken / 4 GPUs = 1.0 s per mini-batch
    "trainer": {"gpu_seconds_per_mtoken": 20000.0, "scaling_exponent": 1.0, "overhead_s": 0.5},
    "transitions": {"weight_sync_s": 0.25},
    "runs": [{"name": "static", "train_gpus": 4, "rollout_gpus": 4}],
}


def test_hand_computed_timeline_matches_exactly():
    """By hand: sample k is admitted when window k opens and runs 1 s, paused 0.25 s by each sync.

    t=0: sample 0 starts; step 1 waits for it until t=1, trains 1 s (the
    staleness budget of 1 blocks sample 1), closes the window at t=2, which
    admits sample 1; the sync pauses the replica 2.00-2.25, so sample 1 ends
    at 3.25; step 2 trains 3.25-4.25, syncs to 4.5; and so on: step k ends at
    2.25 k, waits 1 s for its sample (step 1 included) and trains 1 s.
    """
    scenario = parse_scenario(HAND)
    result = simulate_run(scenario, scenario.runs[0])
    ends = [s.end_s for s in result.steps]
    assert ends == pytest.approx([2.25, 4.5, 6.75], abs=1e-9)
    assert [s.start_s for s in result.steps] == pytest.approx([0.0, 2.25, 4.5], abs=1e-9)
    assert [s.stall_s for s in result.steps] == pytest.approx([1.0, 1.0, 1.0], abs=1e-9)
    assert [s.train_s for s in result.steps] == pytest.approx([1.0, 1.0, 1.0], abs=1e-9)
    assert [s.complete_s for s in result.steps] == pytest.approx([0.25] * 3, abs=1e-9)
    assert [s.mq_size for s in result.steps] == [0, 0, 0]
    assert [c[:2] for c in result.calls] == [(2.0, "sync"), (4.25, "sync"), (6.5, "sync")]
    # section 4 metrics by hand: U_train = 1 / (1 wait + 1 train); U_rollout: window 1 = 1 s busy of 2 s,
    # windows 2, 3 = 1.25 s busy (0.25 s of it paused by the sync, still active) of 2.25 s
    assert [s.train_utilization for s in result.steps] == pytest.approx([0.5] * 3)
    assert [s.rollout_utilization for s in result.steps] == pytest.approx([0.5, 1.25 / 2.25, 1.25 / 2.25])
    # U_cluster = (a U_train + b U_rollout) / (a + b) with x = 0 (no hybrid), a = b = 4
    assert [s.resource_utilization for s in result.steps] == pytest.approx(
        [(4 * 0.5 + 4 * u) / 8 for u in (0.5, 1.25 / 2.25, 1.25 / 2.25)])
    # sample 3 was admitted when window 3 closed at 6.5 and is still decoding at the end (6.75)
    assert result.generated == 3 and result.consumed == 3


HAND_DYNAMIC = {
    "name": "hand-dynamic", "seed": 1, "steps": 2,
    "cluster": {"total_gpus": 8, "gpus_per_node": 4},
    # two samples per mini-batch and per step; staleness 1.0: at most 4 samples per window
    "workload": {"n": 1, "ppo_mini_batch_size": 2, "trigger_parameter_sync_step": 1, "staleness_threshold": 1.0,
                 "prompt_tokens": 0,
                 "response_lengths": {"median": 100, "sigma": 0.0, "max_tokens": 1000, "growth_per_step": 0.0}},
    # 100 tokens/s shared by the requests of a replica; a resumed request re-prefills its 25 done tokens at
    # 100 tokens/s (= 25 tokens of work) and pays 50 more
    "engine": {"gpus_per_replica": 4, "peak_tokens_per_s": 100.0, "half_saturation_concurrency": 0.0,
               "concurrent_samples_per_replica": 1, "hybrid_throughput_factor": 1.0,
               "prefill_tokens_per_s": 100.0, "resume_cost_tokens": 50.0},
    # 0.5 s + 200 tokens / 1e6 x 10000 / 4 GPUs = 1.0 s per mini-batch
    "trainer": {"gpu_seconds_per_mtoken": 10000.0, "scaling_exponent": 1.0, "overhead_s": 0.5},
    "transitions": {"weight_sync_s": 0.25, "sleep_s": 0.5, "wake_s": 0.5, "abort_s": 0.0, "resume_s": 0.0,
                    "routing_s": 0.0},
    # fixed_ratio 1.0: wait for the whole step's 2 samples; activate whenever generation lags
    "scheduling": {"dynamic_schedule_policy": "fixed_ratio", "dynamic_schedule_deactivate_ratio": 1.0},
    "runs": [{"name": "dynamic", "train_gpus": 4, "rollout_gpus": 4, "dynamic": True}],
}


def test_hand_computed_dynamic_timeline_through_the_core():
    """By hand (s_k = k-th sample, 1 s alone on a replica):

    step 1: s0 0-1, s1 1-2 on the standalone; the trainer waits 2 s, trains 2-3 while s2 runs 2-3, s3
    starts at 3. Complete: gap 2 + 2 - 3 = 1 > 0 -> standalone sync 3-3.25 (s3 paused, ends 4.25),
    hybrid sync 3.25-3.5, wake 3.5-4.0, add + resume + rebalance at 4.0; capacity 2 admits s4 on the
    idle hybrid at 4.0.
    step 2: wait for 2 buffered: s2 queued, s3 ends at 4.25 (waited 0.25 s); s5 goes to the standalone;
    release: remove, abort s4 (25 of 100 tokens done -> 75 + 25 + 50 = 150 tokens left), sleep 4.25-4.75;
    train 4.75-5.75; s4 and s5 share the standalone at 50 tokens/s each; complete: standalone sync
    5.75-6.0, hybrid sync 6.0-6.25 (s5 ends 6.5), wake 6.25-6.75, add at 6.75, where s6 goes to the hybrid.
    """
    scenario = parse_scenario(HAND_DYNAMIC)
    result = simulate_run(scenario, scenario.runs[0])
    s1, s2 = result.steps
    assert (s1.start_s, s1.end_s, s1.stall_s, s1.train_s, s1.complete_s) == pytest.approx((0, 4.0, 2.0, 1.0, 1.0))
    assert (s1.deactivated, s1.activated, s1.mq_size) == (False, True, 1)
    assert (s2.end_s, s2.waited_s, s2.release_s, s2.stall_s, s2.complete_s) == pytest.approx(
        (6.75, 0.25, 0.5, 0.0, 1.0))
    assert (s2.deactivated, s2.wait_samples, s2.aborted_requests, s2.activated, s2.mq_size) == (True, 2, 1, True, 0)
    assert [(round(t, 9), name, ids) for t, name, ids in result.calls] == [
        (3.0, "sync", ("standalone-0",)), (3.25, "sync", ("hybrid-0",)), (3.5, "wake", ("hybrid-0",)),
        (4.0, "add", ("hybrid-0",)), (4.0, "resume", ("hybrid-0",)), (4.0, "clear_sticky", ()),
        (4.0, "rebalance", ()),
        (4.25, "remove", ("hybrid-0",)), (4.25, "abort", ("hybrid-0",)), (4.25, "sleep", ("hybrid-0",)),
        (5.75, "sync", ("standalone-0",)), (6.0, "sync", ("hybrid-0",)), (6.25, "wake", ("hybrid-0",)),
        (6.75, "add", ("hybrid-0",)), (6.75, "resume", ("hybrid-0",)), (6.75, "clear_sticky", ()),
        (6.75, "rebalance", ())]
    assert result.generated == 5   # s0-s3, and s5 at 6.5; the resumed s4 is still decoding at 6.75
    # section 4 by hand: step 1 U_train = 1 / (2 + 1), rollout always at capacity, x = 0;
    # step 2 U_train = 1 / 1, x = 0.25 wait / 1.0 step -> ((0.75 x 4) x 1 + (0.25 x 4 + 4) x 1) / 8 = 1
    assert s1.train_utilization == pytest.approx(1 / 3) and s1.rollout_utilization == pytest.approx(1.0)
    assert s1.resource_utilization == pytest.approx((4 / 3 + 4) / 8)
    assert (s2.train_utilization, s2.rollout_utilization, s2.resource_utilization) == pytest.approx((1, 1, 1))
    # the resumed s4 (150 tokens of work) ends at 7.0: one more step shows it as the next wait's end
    third = simulate_run(scenario, scenario.runs[0], steps=3).steps[2]
    assert (third.start_s, third.waited_s) == pytest.approx((6.75, 0.25))
