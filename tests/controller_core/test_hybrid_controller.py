"""DynamicResourceController with fake ports and a fake clock: orders, failures, protocol, persistence."""

from __future__ import annotations

import pytest

from controller.core import (
    DynamicResourceController,
    EventType,
    HybridState,
    InvalidArgumentError,
    OutOfOrder,
    PortUnavailable,
    ReplicaKind,
    ReplicaRegistry,
    ReplicaSpec,
    ReplicaState,
    SchedulingConfig,
    StepCall,
)
from controller.core.metrics import RESOURCE_UTILIZATION, TRAIN_ALLOCATED_TIME
from controller.core.policies import DynamicSchedulePolicyBase
from mesh_runtime.json_values import from_struct

from .conftest import AHEAD, LAGGING, build_mesh, report
from .fakes import FakeClock, FakeReplicas, FakeRouting, FakeWeights

pytestmark = pytest.mark.timeout(60)

S, K = ReplicaState, ReplicaKind


async def activate_in_step_1(mesh, ctrl):
    await ctrl.begin_step(1, report(**LAGGING))
    return await ctrl.complete_step(1, 1, report(**LAGGING))


async def test_full_cycle_orders_durations_and_adaptation(mesh):
    ctrl = mesh.controller()
    # step 1: hybrids asleep -> no deactivation; lagging -> activation (1000 s default estimate)
    begin = await ctrl.begin_step(1, report(**LAGGING))
    assert (begin.deactivate, begin.wait_samples, begin.next_call) == (False, 0, StepCall.COMPLETE_TRAINING_STEP)
    done = await ctrl.complete_step(1, 1, report(**LAGGING))
    assert mesh.log[0] == ("sync", ("s1", "s2"), 1)                      # standalone first, always
    assert mesh.ops(1) == ["sync", "wake", "add", "resume", "clear_sticky", "rebalance"]
    assert mesh.log[1] == ("sync", ("h1", "h2"), 1)
    assert done.hybrid_activated and done.rebalanced and not done.hybrid_sync_skipped
    assert done.activation_duration_s == pytest.approx(3.0 + 1.0 * 2 + 0.5 + 0.25 * 2)   # sync, wakes, add, resumes
    assert done.bytes_sent == 4000 and done.bytes_saved == 0
    assert ctrl.hybrid_state is HybridState.HYBRID_ACTIVE
    # verl: the cycle's activation (6.0 s) plus its rebalance (clear 0.5 + rebalance 0.5 s) accumulate,
    # update_after_step records them as one switch overhead, then the context's durations reset
    assert ctrl.policy.switch_cost_history == [pytest.approx(7.0)]
    assert ctrl.ctx.last_activate_duration_s == 0.0 and ctrl.ctx.last_deactivate_duration_s == 0.0
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.ACTIVE, S.ACTIVE]
    assert mesh.registry.get("h1").weight_version == 1

    # step 2: deactivate after int(0.3 x 32 x 4) = 38 samples
    begin = await ctrl.begin_step(2, report(**LAGGING))
    assert (begin.deactivate, begin.wait_samples, begin.wait_timeout_s) == (True, 38, 600.0)
    start = len(mesh.log)
    released = await ctrl.release_hybrid(2, buffered_samples=40, waited_s=12.0, wait_expired=False)
    assert mesh.ops(start) == ["remove", "abort", "sleep"]
    assert mesh.log[start] == ("remove", ("h1", "h2"))
    assert ("sleep", ("h1",), 1) in mesh.log
    assert released.released_replica_ids == ("h1", "h2") and released.aborted_requests == 6
    assert released.duration_s == pytest.approx(0.5 + 0.5 * 2 + 2.0 * 2)
    assert ctrl.hybrid_state is HybridState.STANDALONE_ONLY
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.SLEEPING, S.SLEEPING]

    # complete 2: ahead -> no activation; the hybrid sync is skipped and its bytes counted
    start = len(mesh.log)
    done = await ctrl.complete_step(2, 2, report(**AHEAD, step_wait_times=[0.0], step_wait_samples=[0]))
    assert mesh.log[start:] == [("sync", ("s1", "s2"), 2)]
    assert done.hybrid_sync_skipped and done.bytes_saved == 2000 and not done.hybrid_activated
    skipped = mesh.events_of(EventType.WEIGHT_SYNC_SKIPPED)[-1]
    assert skipped.details["bytes_saved"] == 2000 and skipped.weight_version == 2
    assert skipped.attributes["bytes_saved"] == "2000"   # the string map, for clients written against it
    assert done.deactivate_ratio == pytest.approx(0.28)          # used, no waits: 0.3 - 0.02
    assert ctrl.policy.switch_cost_history == [pytest.approx(7.0), pytest.approx(5.5)]   # cycle 2: the release

    # step 3: 4 s over 8 waited samples = 0.5 s/sample; verl's gap 0.28 x 128 - (100 - 128) = 63.84 samples,
    # x 0.5 = 31.9 s > switch cost mean(7.0, 5.5) = 6.25 s -> activate
    begin = await ctrl.begin_step(3, report(**LAGGING))
    assert not begin.deactivate
    done = await ctrl.complete_step(3, 3, report(**LAGGING, step_wait_times=[4.0], step_wait_samples=[8]))
    assert done.hybrid_activated
    assert ctrl.policy.per_sample_time_s == pytest.approx(0.5)
    assert done.deactivate_ratio == pytest.approx(0.28)          # ratio not used in step 3: unchanged
    assert ctrl.activations == 2 and ctrl.deactivations == 1

    h1_moves = [(e.from_state, e.to_state) for e in mesh.events_of(EventType.REPLICA_STATE_CHANGED)
                if e.replica_id == "h1" and e.from_state]
    assert h1_moves[:5] == [("REPLICA_STATE_SLEEPING", "REPLICA_STATE_SYNCING"),
                            ("REPLICA_STATE_SYNCING", "REPLICA_STATE_PAUSED"),
                            ("REPLICA_STATE_PAUSED", "REPLICA_STATE_ACTIVE"),
                            ("REPLICA_STATE_ACTIVE", "REPLICA_STATE_DRAINING"),
                            ("REPLICA_STATE_DRAINING", "REPLICA_STATE_SLEEPING")]
    assert mesh.spans[:1] == ["hybrid.begin_step"]
    assert {"hybrid.activate", "weights.broadcast", "replica.wake", "hybrid.deactivate", "replica.sleep",
            "hybrid.rebalance"} <= set(mesh.spans)


async def test_active_hybrids_get_the_serving_sync_and_nothing_is_skipped(mesh):
    ctrl = mesh.controller(dynamic_schedule_policy="fixed_ratio")
    await activate_in_step_1(mesh, ctrl)
    ctrl.policy.should_deactivate = lambda *args: False            # keep them active through step 2
    await ctrl.begin_step(2, report(**AHEAD))
    start = len(mesh.log)
    done = await ctrl.complete_step(2, 2, report(**AHEAD))
    assert mesh.log[start:] == [("sync", ("h1", "h2", "s1", "s2"), 2)]
    assert not done.hybrid_sync_skipped and done.bytes_saved == 0


async def test_out_of_order_calls_name_the_expected_call(mesh):
    ctrl = mesh.controller()
    with pytest.raises(OutOfOrder, match="ReleaseHybridReplicas is out of order: the controller expects "
                                         "BeginTrainingStep next"):
        await ctrl.release_hybrid(1, 0, 0.0)
    with pytest.raises(OutOfOrder, match="expects BeginTrainingStep"):
        await ctrl.complete_step(1, 1, report())
    await ctrl.begin_step(1, report(**LAGGING))
    with pytest.raises(OutOfOrder, match="expects CompleteTrainingStep for global_step 1"):
        await ctrl.release_hybrid(1, 0, 0.0)
    with pytest.raises(OutOfOrder, match="expects CompleteTrainingStep"):
        await ctrl.begin_step(2, report())
    with pytest.raises(InvalidArgumentError, match="not the current step 1"):
        await ctrl.complete_step(5, 1, report())
    await ctrl.complete_step(1, 1, report(**LAGGING))
    await ctrl.begin_step(2, report())
    with pytest.raises(OutOfOrder, match="expects ReleaseHybridReplicas for global_step 2") as info:
        await ctrl.complete_step(2, 2, report())
    assert info.value.expected == "ReleaseHybridReplicas" and info.value.reason == "STEP_OUT_OF_ORDER"
    with pytest.raises(OutOfOrder, match="expects ReleaseHybridReplicas"):
        await ctrl.begin_step(3, report())
    await ctrl.release_hybrid(2, 38, 1.0)
    await ctrl.complete_step(2, 2, report(**AHEAD))
    with pytest.raises(InvalidArgumentError, match="not greater than the last completed step 2"):
        await ctrl.begin_step(1, report())
    with pytest.raises(InvalidArgumentError, match="weight_version 1 is lower"):
        await ctrl.begin_step(3, report())
        await ctrl.complete_step(3, 1, report())
    with pytest.raises(InvalidArgumentError, match="must be parallel lists"):
        await ctrl.complete_step(3, 3, report(step_wait_times=[1.0]))


async def test_repeated_calls_return_the_recorded_answer(mesh):
    ctrl = mesh.controller()
    first = await ctrl.begin_step(1, report(**LAGGING))
    assert await ctrl.begin_step(1, report(**AHEAD)) is first
    done = await ctrl.complete_step(1, 1, report(**LAGGING))
    calls = len(mesh.log)
    assert await ctrl.complete_step(1, 1, report(**LAGGING)) is done
    assert await ctrl.begin_step(1, report()) is first                 # still the current step
    await ctrl.begin_step(2, report())
    released = await ctrl.release_hybrid(2, 40, 3.0)
    calls = len(mesh.log)
    assert await ctrl.release_hybrid(2, 40, 3.0) is released
    assert len(mesh.log) == calls and ctrl.deactivations == 1


async def test_failing_sleep_marks_only_that_replica_failed(mesh):
    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    mesh.replicas.fail["sleep"] = {"h2": "CUDA error"}
    await ctrl.begin_step(2, report())
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.released_replica_ids == ("h1",) and released.failed_replica_ids == ("h2",)
    assert mesh.state("h1") is S.SLEEPING and mesh.state("h2") is S.FAILED
    assert mesh.registry.get("h2").state_reason == "sleep failed: CUDA error; stopped to free its memory"
    assert ("stop", ("h2",)) in mesh.log
    # the failed replica is left out of the next activation
    await ctrl.complete_step(2, 2, report(**AHEAD))
    await ctrl.begin_step(3, report())
    done = await ctrl.complete_step(3, 3, report(**LAGGING))
    assert done.hybrid_activated and mesh.state("h1") is S.ACTIVE and mesh.state("h2") is S.FAILED


async def test_unreachable_agent_on_wake_fails_its_replica_and_the_other_activates(mesh):
    ctrl = mesh.controller()
    mesh.replicas.raise_for["wake"] = {"h2"}
    done = await activate_in_step_1(mesh, ctrl)
    assert done.hybrid_activated and done.failed_replica_ids == ("h2",)
    assert mesh.state("h1") is S.ACTIVE and mesh.state("h2") is S.FAILED
    assert "wake failed: ConnectionError: wake: agent unreachable" in mesh.registry.get("h2").state_reason
    assert ("add", ("h1",)) in mesh.log


async def test_a_hung_agent_times_out_instead_of_hanging(mesh):
    ctrl = mesh.controller(port_timeout_s=0.01)
    await activate_in_step_1(mesh, ctrl)
    mesh.replicas.hang["sleep"] = {"h2"}
    await ctrl.begin_step(2, report())
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.failed_replica_ids == ("h2",) and mesh.state("h1") is S.SLEEPING
    assert mesh.registry.get("h2").state_reason.startswith("sleep failed: timed out")


async def test_routing_failure_on_release_changes_nothing_and_can_be_retried(mesh):
    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    await ctrl.begin_step(2, report())
    mesh.routing.fail.add("remove")
    with pytest.raises(PortUnavailable, match="nothing was slept, retry the call"):
        await ctrl.release_hybrid(2, 40, 3.0)
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.ACTIVE, S.ACTIVE]
    assert ctrl.next_call is StepCall.RELEASE_HYBRID_REPLICAS
    mesh.routing.fail.clear()
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.released_replica_ids == ("h1", "h2")


async def test_failed_add_puts_woken_replicas_back_to_sleep(mesh):
    ctrl = mesh.controller()
    mesh.routing.fail.add("add")
    done = await activate_in_step_1(mesh, ctrl)
    assert not done.hybrid_activated and ctrl.hybrid_state is HybridState.STANDALONE_ONLY
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.SLEEPING, S.SLEEPING]
    assert mesh.ops()[-3:] == ["wake", "add", "sleep"]


async def test_weight_sync_failures(mesh):
    ctrl = mesh.controller()
    await ctrl.begin_step(1, report(**AHEAD))
    mesh.weights.raise_error = ConnectionError("trainer gone")
    with pytest.raises(PortUnavailable, match="serving weight sync to version 1 failed"):
        await ctrl.complete_step(1, 1, report(**AHEAD))
    assert [mesh.state(r) for r in ("s1", "s2")] == [S.ACTIVE, S.ACTIVE]
    assert mesh.registry.get("s1").weight_version == 0 and ctrl.next_call is StepCall.COMPLETE_TRAINING_STEP
    mesh.weights.raise_error = None
    mesh.weights.fail = {"s2": "checksum mismatch", "h2": "checksum mismatch"}
    done = await ctrl.complete_step(1, 1, report(**LAGGING))        # retry succeeds
    assert mesh.registry.get("s1").weight_version == 1
    assert mesh.registry.get("s2").weight_version == 0 and mesh.state("s2") is S.ACTIVE   # keeps serving v0
    assert "checksum mismatch" in mesh.registry.get("s2").state_reason
    assert mesh.state("h2") is S.FAILED and mesh.state("h1") is S.ACTIVE and done.hybrid_activated
    failed_events = {e.replica_id for e in mesh.events_of(EventType.WEIGHT_SYNC_FAILED) if e.replica_id}
    assert failed_events == {"s2", "h2"}


async def test_a_replica_lost_during_a_sync_stays_lost_and_the_step_completes(mesh):
    """A lease that expires while the broadcast runs marks the replica FAILED; the sync does not revive it."""
    ctrl = mesh.controller()
    await ctrl.begin_step(1, report(**AHEAD))
    original = mesh.weights.sync

    async def sync_while_s2_dies(replica_ids, version):
        if "s2" in replica_ids:
            mesh.registry.transition("s2", S.FAILED, "lease expired")
            mesh.weights.fail = {"s2": "ReceiveWeights on s0:1: UNAVAILABLE"}
        return await original(replica_ids, version)

    mesh.weights.sync = sync_while_s2_dies
    done = await ctrl.complete_step(1, 1, report(**AHEAD))
    assert done.standalone_sync is not None
    assert mesh.state("s1") is S.ACTIVE and mesh.registry.get("s1").weight_version == 1
    assert mesh.state("s2") is S.FAILED and mesh.registry.get("s2").state_reason == "lease expired"
    assert ctrl.next_call is StepCall.BEGIN_TRAINING_STEP
    # an invalid transition of a replica the operation still owns is a bug and still raises
    with pytest.raises(Exception, match="cannot go from"):
        ctrl.ops._move("s1", S.SLEEPING, "nonsense", 1)


async def test_wait_expiry_is_reported(mesh):
    ctrl = mesh.controller(deactivate_wait_timeout_s=45.0)
    await activate_in_step_1(mesh, ctrl)
    begin = await ctrl.begin_step(2, report())
    assert begin.wait_timeout_s == 45.0
    released = await ctrl.release_hybrid(2, buffered_samples=10, waited_s=45.0, wait_expired=True)
    assert released.wait_expired
    expired = mesh.events_of(EventType.WAIT_EXPIRED)
    assert len(expired) == 1 and "10 of 38 samples" in expired[0].reason and expired[0].global_step == 2


async def test_out_of_band_release_goes_through_the_state_machine(mesh):
    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    released = await ctrl.release_out_of_band("validation")
    assert released.released_replica_ids == ("h1", "h2") and ctrl.hybrid_state is HybridState.STANDALONE_ONLY
    start = len(mesh.log)
    begin = await ctrl.begin_step(2, report())
    assert not begin.deactivate and mesh.log[start:] == []           # no second deactivation
    with pytest.raises(OutOfOrder, match="release_out_of_band is out of order"):
        await ctrl.release_out_of_band("validation")


async def test_serving_hybrids_found_at_begin_are_released(mesh):
    mesh.registry.register_node("t2", "t2:1", replicas=[ReplicaSpec("h2", K.HYBRID, S.ACTIVE)])
    ctrl = mesh.controller()
    begin = await ctrl.begin_step(1, report())
    assert begin.deactivate and begin.hybrid_state is HybridState.HYBRID_ACTIVE
    released = await ctrl.release_hybrid(1, 40, 1.0)
    assert released.released_replica_ids == ("h2",)


async def test_disabled_scheduling_never_consults_the_policy(mesh):
    class Tripwire(DynamicSchedulePolicyBase):
        def should_deactivate(self, *a):
            raise AssertionError("policy called")

        deactivate_wait_samples = should_activate_after_step = update_after_step = should_deactivate

    ctrl = mesh.controller(use_dynamic_resource_scheduling=False, policy=Tripwire())
    begin = await ctrl.begin_step(1, report(**LAGGING))
    done = await ctrl.complete_step(1, 1, report(**LAGGING))
    assert not begin.deactivate and not done.hybrid_activated
    assert done.hybrid_sync_skipped and done.bytes_saved == 2000


async def test_reference_api_policy_runs_unchanged(mesh):
    import tests.controller_core.reference_policy  # noqa: F401 - registers "my_policy"

    ctrl = mesh.controller(dynamic_schedule_policy="my_policy", dynamic_schedule_deactivate_ratio=0.5)
    done = await activate_in_step_1(mesh, ctrl)
    assert done.hybrid_activated and not done.rebalanced                # its request_rebalance returns None
    assert "rebalance" not in mesh.ops()
    begin = await ctrl.begin_step(2, report())
    assert begin.deactivate and begin.wait_samples == int(32 * 4 * 0.5)
    await ctrl.release_hybrid(2, 64, 5.0)
    done = await ctrl.complete_step(2, 2, report(**AHEAD))
    assert not done.hybrid_activated and done.hybrid_sync_skipped and done.deactivate_ratio == 0.5
    state = ctrl.scheduler_state()
    assert state.policy_name == "my_policy" and state.switch_cost_s is None
    assert from_struct(ctrl.to_document().policy) == {"deactivate_ratio": 0.5}


async def test_policy_by_import_path_through_the_controller(mesh):
    ctrl = mesh.controller(dynamic_schedule_policy="tests.controller_core.custom_policy_module:TinyPolicy",
                           dynamic_schedule_policy_params={"wait": 5})
    await activate_in_step_1(mesh, ctrl)
    assert (await ctrl.begin_step(2, report())).wait_samples == 5


async def test_metrics_cycles_follow_weight_syncs(mesh):
    ctrl = mesh.controller()
    await ctrl.begin_step(1, report(**LAGGING))
    await ctrl.complete_step(1, 1, report(**LAGGING, train_allocated_time_s=10.0, timing_raw={"step": 10.0}))
    assert [c.cycle for c in mesh.metrics.cycles()] == [1]
    await ctrl.begin_step(2, report())
    await ctrl.release_hybrid(2, 40, 4.0)
    await ctrl.complete_step(2, 1, report(**AHEAD, train_allocated_time_s=6.0, timing_raw={"step": 10.0}))
    assert len(mesh.metrics.cycles()) == 1                               # same version: no sync, cycle open
    await ctrl.begin_step(3, report())
    await ctrl.complete_step(3, 2, report(**AHEAD, train_allocated_time_s=5.0, timing_raw={"step": 10.0}))
    second = mesh.metrics.cycles()[-1]
    assert second.cycle == 2 and second.values[TRAIN_ALLOCATED_TIME] == 11.0
    assert second.values[RESOURCE_UTILIZATION] >= 0.0


async def test_document_round_trip_resumes_mid_step():
    original = build_mesh()
    ctrl = original.controller()
    await activate_in_step_1(original, ctrl)
    await ctrl.begin_step(2, report())
    released = await ctrl.release_hybrid(2, 40, 12.0)
    saved_ctrl, saved_registry = ctrl.to_document(), original.registry.documents()

    clock = FakeClock(original.clock())
    log: list = []
    registry = ReplicaRegistry.from_documents(saved_registry, clock=clock)
    restored = DynamicResourceController(
        SchedulingConfig(**ctrl.config.__dict__), registry=registry, routing=FakeRouting(log, clock, 0.5),
        replicas=FakeReplicas(log, clock), weights=FakeWeights(log, clock, 1000, 3.0), clock=clock)
    restored.restore(saved_ctrl)
    assert restored.to_document() == saved_ctrl
    assert await restored.release_hybrid(2, 40, 12.0) == released and log == []
    with pytest.raises(OutOfOrder, match="expects CompleteTrainingStep"):
        await restored.begin_step(3, report())
    done_restored = await restored.complete_step(2, 2, report(**AHEAD))
    done_original = await ctrl.complete_step(2, 2, report(**AHEAD))
    assert done_restored == done_original
    assert restored.policy.state_dict() == ctrl.policy.state_dict()


async def test_scheduler_state_snapshot(mesh):
    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    state = ctrl.scheduler_state()
    assert state.enabled and state.hybrid_state is HybridState.HYBRID_ACTIVE
    assert state.next_call is StepCall.BEGIN_TRAINING_STEP and state.last_global_step == 1
    assert state.hybrid_replica_ids == ("h1", "h2") and state.switch_cost_s == pytest.approx(7.0)
    assert state.per_sample_time_s == 1000.0 and state.deactivate_ratio == 0.3
    assert state.policy_parameters["min_ratio"] == 0.05


def test_config_validation_names_the_field():
    with pytest.raises(InvalidArgumentError, match="deactivate_wait_timeout_s must be > 0"):
        SchedulingConfig(deactivate_wait_timeout_s=0).validate()
    with pytest.raises(InvalidArgumentError, match="sleep_level must be 1 or 2"):
        SchedulingConfig(sleep_level=3).validate()
    assert SchedulingConfig().required_samples == 256


async def test_interrupted_release_is_finished_by_the_retry(mesh):
    import asyncio

    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    await ctrl.begin_step(2, report())
    mesh.replicas.hang["abort"] = {"h1"}
    with pytest.raises(TimeoutError):                        # the caller gave up mid-release
        await asyncio.wait_for(ctrl.release_hybrid(2, 40, 3.0), 0.01)
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.DRAINING, S.DRAINING]
    mesh.replicas.hang.clear()
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.released_replica_ids == ("h1", "h2")
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.SLEEPING, S.SLEEPING]
    assert ctrl.deactivations == 1


async def test_an_agent_registering_again_during_a_release_does_not_break_it(mesh):
    # the controller restarted mid-release; the agent registered again, reporting h1 as it was then (ACTIVE),
    # while the retried release was waiting for its sleep: the release still ends with h1 asleep
    from controller.core.records import ReplicaSpec

    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    await ctrl.begin_step(2, report())
    mesh.replicas.during["sleep"] = lambda: mesh.registry.register_node(
        "t1", "t1:1", replicas=[ReplicaSpec("h1", K.HYBRID, S.ACTIVE)])
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert released.released_replica_ids == ("h1", "h2")
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.SLEEPING, S.SLEEPING]


async def test_a_replica_reported_asleep_during_the_retried_release_counts_as_released(mesh):
    # the leader died after its release had slept h1; the agent registered with the new leader, reporting
    # h1 SLEEPING, while the trainer's retried release was waiting for the balancer to take h1 out
    from controller.core.records import ReplicaSpec

    ctrl = mesh.controller()
    await activate_in_step_1(mesh, ctrl)
    await ctrl.begin_step(2, report())
    mesh.routing.during["remove"] = lambda: mesh.registry.register_node(
        "t1", "t1:1", replicas=[ReplicaSpec("h1", K.HYBRID, S.SLEEPING, weight_version=1)])
    released = await ctrl.release_hybrid(2, 40, 3.0)
    assert set(released.released_replica_ids) == {"h1", "h2"} and not released.failed_replica_ids
    assert [mesh.state(r) for r in ("h1", "h2")] == [S.SLEEPING, S.SLEEPING]
    assert [call for call in mesh.log if call[0] in ("abort", "sleep")] == [("abort", ("h2",)), ("sleep", ("h2",), 1)]


async def test_interrupted_sync_restores_states_and_the_retry_counts_once(mesh):
    import asyncio

    ctrl = mesh.controller()
    await ctrl.begin_step(1, report(**AHEAD))
    mesh.weights.hang = True
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(ctrl.complete_step(1, 1, report(**AHEAD)), 0.01)
    assert [mesh.state(r) for r in ("s1", "s2")] == [S.ACTIVE, S.ACTIVE]
    mesh.weights.hang = False
    done = await ctrl.complete_step(1, 1, report(**AHEAD))
    assert done.standalone_sync is not None and done.hybrid_sync_skipped and done.bytes_saved == 2000
    assert len(mesh.metrics.cycles()) == 1


async def test_hybrid_left_syncing_is_put_back_to_sleep_at_begin(mesh):
    ctrl = mesh.controller()
    mesh.registry.transition("h1", S.SYNCING, "an activation that never finished")
    begin = await ctrl.begin_step(1, report())
    assert mesh.state("h1") is S.SLEEPING and not begin.deactivate
