"""``DynamicResourceController``: the ``STANDALONE_ONLY <-> HYBRID_ACTIVE`` machine and step protocol.

Per training step the trainer calls, in this order (anything else raises
:class:`~controller.core.errors.OutOfOrder` naming the expected call; a
repeated call for the current step returns the recorded answer):

1. ``begin_step(global_step, report)`` - the report refreshes the context;
   policy point 1 ``should_deactivate`` and, when it says yes, point 2
   ``deactivate_wait_samples``. The answer carries ``wait_timeout_s``
   (``deactivate_wait_timeout_s``): the trainer's wait is bounded.
2. ``release_hybrid(global_step, buffered_samples, waited_s, wait_expired)`` -
   only after a deactivate answer: remove from routing -> abort -> sleep
   (``HybridOperations.deactivate``); an expired wait is reported as a
   WAIT_EXPIRED event.
3. ``complete_step(global_step, weight_version, report)``:
   a. the report refreshes the context;
   b. weights go to every serving replica (standalone, plus hybrid ones that
      stayed active) - always, when the version is new to them;
   c. the metrics cycle closes if ``weight_version`` is new (a cycle is the
      reports between two parameter syncs);
   d. ``policy.observe_step(outcome)`` (an optional rollmesh hook) - the
      policy learns whether this step deactivated (i.e. used its ratio) and
      the wait; estimates (per-sample time) are refreshed here, every step;
   e. point 3 ``should_activate_after_step`` - on the estimates from (d) and
      the ratio from before this step's update;
   f. if activating: hybrid weight sync -> wake -> add -> resume, then point 4
      ``request_rebalance`` (only when ``dynamic_schedule_enable_rebalance``;
      a truthy answer, or a call of ``self._rollouter.rebalance_requests``
      the verl way, triggers clear-sticky + rebalance). Otherwise the hybrid
      weight sync is skipped and its bytes counted as saved (WEIGHT_SYNC_SKIPPED);
   g. point 5 ``update_after_step`` - the ratio for the next step; then the
      context's switch durations are reset to 0.

The context's ``last_deactivate_duration_s`` / ``last_activate_duration_s``
are accumulated over the cycle, as verl's trainer does: every release adds
its duration, every activation its duration plus that of the rebalance that
follows it; ``update_after_step`` sees the cycle's totals, then both reset.
Any class with the reference's three required methods is a policy; optional
methods are detected (:class:`~controller.core.policies.PolicyHandle`).

With ``use_dynamic_resource_scheduling`` off the policy is never consulted:
hybrid replicas that are somehow serving are released without a wait and
never activated.

Step calls are serialised by an ``asyncio.Lock``; every port call inside is
bounded by a configured timeout, so a waiting call never waits unbounded. A
call interrupted half-way (cancelled by its caller) leaves the step where it
was and the retry finishes it: DRAINING hybrids are released by the retried
release, serving replicas are restored if their sync is interrupted, and a
hybrid left SYNCING goes back to SLEEPING at the next ``begin_step``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from mesh_runtime.json_values import from_struct, to_struct
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .config import SchedulingConfig
from .context import DynamicScheduleContext
from .errors import InvalidArgumentError, OutOfOrder
from .events import EventSink, EventType
from .hybrid_ops import HybridOperations
from .metrics import CycleMetrics
from .policies import DynamicSchedulePolicyBase, PolicyHandle, StepOutcome, create_policy
from .ports import Clock, ReplicaPort, RoutingPort, Tracer, WeightSyncOutcome, WeightSyncPort, no_tracer
from .records import ReplicaKind, ReplicaState
from .replicas import ReplicaRegistry
from .steps import (
    BeginDecision,
    CompleteResult,
    HybridState,
    ReleaseResult,
    StepCall,
    StepReport,
)

S = ReplicaState
SERVING = (S.ACTIVE, S.PAUSED)
HOLDING = (S.ACTIVE, S.PAUSED, S.DRAINING)
"""Hybrid states that hold GPU memory and must be released before training (DRAINING: a release
that was interrupted after routing removal; the retry finishes it)."""


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """Snapshot for GetSchedulerState."""

    enabled: bool
    hybrid_state: HybridState
    policy_name: str
    policy_parameters: dict[str, Any]
    deactivate_ratio: float | None
    switch_cost_s: float | None
    per_sample_time_s: float | None
    next_call: StepCall
    last_global_step: int | None
    activations: int
    deactivations: int
    only_hybrid: bool
    enable_rebalance: bool
    last_activate_duration_s: float
    last_deactivate_duration_s: float
    hybrid_replica_ids: tuple[str, ...]
    bytes_saved_total: int


class DynamicResourceController:
    """Owns the hybrid state machine and runs the per-step protocol against the ports."""

    def __init__(self, config: SchedulingConfig, *, registry: ReplicaRegistry, routing: RoutingPort,
                 replicas: ReplicaPort, weights: WeightSyncPort, clock: Clock, emit: EventSink | None = None,
                 tracer: Tracer | None = None, metrics: CycleMetrics | None = None,
                 policy: DynamicSchedulePolicyBase | None = None, lock: asyncio.Lock | None = None) -> None:
        """``lock`` is taken around every step-protocol call: the controller passes the one lock of every
        routing and weight change (``Mesh.transitions``), so a step never interleaves with a scale operation
        or a weight sync; alone (the simulator, the tests) the scheduler has its own."""
        self.config = config.validate()
        self.registry = registry
        self.clock = clock
        self.emit: EventSink = emit or _ignore
        self.tracer: Tracer = tracer or no_tracer
        self.metrics = metrics
        self.weights = weights
        self.policy = policy or create_policy(
            config.dynamic_schedule_policy, deactivate_ratio=config.dynamic_schedule_deactivate_ratio,
            only_hybrid=config.only_hybrid, **config.dynamic_schedule_policy_params)
        self._policy = PolicyHandle(self.policy)
        self.ops = HybridOperations(config, registry=registry, routing=routing, replicas=replicas,
                                    weights=weights, clock=clock, emit=self.emit, tracer=self.tracer)
        self.ctx = DynamicScheduleContext(required_samples=config.required_samples,
                                          trigger_parameter_sync_step=config.trigger_parameter_sync_step,
                                          only_hybrid=config.only_hybrid)
        self.hybrid_state = HybridState.STANDALONE_ONLY
        self.next_call = StepCall.BEGIN_TRAINING_STEP
        self.current_step: int | None = None
        self.last_completed_step: int | None = None
        self.weight_version: int | None = None
        self.activations = 0
        self.deactivations = 0
        self.bytes_saved_total = 0
        self._last_activation_s = 0.0            # duration of the latest activation (for StepOutcome)
        self._begin: BeginDecision | None = None
        self._release: ReleaseResult | None = None
        self._complete: CompleteResult | None = None
        self._outcome = StepOutcome(global_step=-1)
        self._base_version: int | None = None   # weight version when the current step began
        self._fed_step: int | None = None       # last step whose report went into the metrics
        self._lock = lock if lock is not None else asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.config.use_dynamic_resource_scheduling

    @property
    def is_hybrid_active(self) -> bool:
        return self.hybrid_state is HybridState.HYBRID_ACTIVE

    # --- the step protocol ---

    async def begin_step(self, global_step: int, report: StepReport) -> BeginDecision:
        """Call 1: decide whether (and after how many buffered samples) to release hybrids."""
        if global_step < 1:
            raise InvalidArgumentError(f"global_step must be >= 1 (steps count from 1), got {global_step}")
        async with self._lock:
            if global_step == self.current_step and self._begin is not None:
                return self._begin
            self._expect(StepCall.BEGIN_TRAINING_STEP)
            if self.last_completed_step is not None and global_step <= self.last_completed_step:
                raise InvalidArgumentError(f"global_step {global_step} is not greater than the last "
                                           f"completed step {self.last_completed_step}")
            report.validate()
            self._apply_report(report)
            with self.tracer("hybrid.begin_step", global_step=global_step):
                self._reconcile(global_step)
                active = self.is_hybrid_active
                deactivate, wait = active, 0
                if self.enabled:
                    deactivate = self._policy.should_deactivate(global_step, active, self.ctx) and active
                    if deactivate:
                        wait = self._policy.deactivate_wait_samples(self.ctx)
            self.current_step = global_step
            self._base_version = self.weight_version
            self._release = self._complete = None
            self._outcome = StepOutcome(global_step=global_step)
            self.next_call = StepCall.RELEASE_HYBRID_REPLICAS if deactivate else StepCall.COMPLETE_TRAINING_STEP
            self._begin = BeginDecision(global_step, deactivate, wait, self.config.deactivate_wait_timeout_s,
                                        self.hybrid_state, self.next_call)
            self._phase(global_step, "begin", deactivate=deactivate, wait_samples=wait,
                        wait_timeout_s=self.config.deactivate_wait_timeout_s)
            return self._begin

    async def release_hybrid(self, global_step: int, buffered_samples: int, waited_s: float,
                             wait_expired: bool = False) -> ReleaseResult:
        """Call 2: remove -> abort -> sleep the serving hybrid replicas."""
        async with self._lock:
            if global_step == self.current_step and self._release is not None:
                return self._release
            self._expect(StepCall.RELEASE_HYBRID_REPLICAS)
            self._check_current(global_step)
            if buffered_samples < 0 or waited_s < 0:
                raise InvalidArgumentError(f"buffered_samples ({buffered_samples}) and waited_s ({waited_s}) "
                                           f"must be >= 0")
            assert self._begin is not None
            wait_samples = self._begin.wait_samples
            if wait_expired:
                self.emit(EventType.WAIT_EXPIRED, global_step=global_step,
                          reason=f"waited {waited_s:g} s (deactivate_wait_timeout_s="
                                 f"{self.config.deactivate_wait_timeout_s:g}) with {buffered_samples} of "
                                 f"{wait_samples} samples buffered; releasing hybrid replicas anyway",
                          attributes={"buffered_samples": buffered_samples, "wait_samples": wait_samples,
                                      "waited_s": waited_s})
            activate_duration = self._last_activation_s
            result = await self.ops.deactivate(self._serving_hybrid(), global_step=global_step)
            self.ctx.last_deactivate_duration_s += result.duration_s
            self.deactivations += 1
            self._set_state(HybridState.STANDALONE_ONLY, f"hybrid replicas released for step {global_step}",
                            global_step)
            if self.metrics is not None:
                self.metrics.record_deactivation_wait(waited_s)
            self._outcome = StepOutcome(global_step=global_step, deactivated=True, wait_samples=wait_samples,
                                        buffered_samples=buffered_samples, waited_s=waited_s,
                                        wait_expired=wait_expired, deactivate_duration_s=result.duration_s,
                                        activate_duration_s=activate_duration)
            self.next_call = StepCall.COMPLETE_TRAINING_STEP
            self._release = ReleaseResult(global_step, result.released, tuple(result.failed), result.duration_s,
                                          result.aborted_requests, wait_expired, self.hybrid_state, self.next_call)
            self._phase(global_step, "release", released=len(result.released), failed=len(result.failed),
                        duration_s=result.duration_s, wait_expired=wait_expired)
            return self._release

    async def complete_step(self, global_step: int, weight_version: int, report: StepReport) -> CompleteResult:
        """Call 3: weight sync, then policy points 3-5 (see the module docstring)."""
        async with self._lock:
            if global_step == self.current_step and self._complete is not None:
                return self._complete
            self._expect(StepCall.COMPLETE_TRAINING_STEP)
            self._check_current(global_step)
            if weight_version < 0 or (self.weight_version is not None and weight_version < self.weight_version):
                raise InvalidArgumentError(f"weight_version {weight_version} is lower than the version "
                                           f"already broadcast ({self.weight_version})")
            report.validate()
            self._apply_report(report)
            # relative to the step's start, so a retry after an interrupted call sees the same answer
            new_version = self._base_version is None or weight_version > self._base_version
            serving = [r.replica_id for r in self.registry.replicas(states=SERVING)
                       if r.weight_version < weight_version]
            standalone_sync = (await self.ops.sync_serving(serving, weight_version, global_step)
                               if serving else None)
            self.weight_version = weight_version
            self._feed_metrics(report, global_step, weight_version, new_version)
            if self.enabled:
                self._policy.observe_step(global_step, self._outcome, self.ctx)
            active = self.is_hybrid_active
            wants = bool(self.enabled and self._policy.should_activate_after_step(global_step, active, self.ctx))
            sleeping = [r.replica_id for r in self.registry.replicas(kind=ReplicaKind.HYBRID, states=[S.SLEEPING])]
            activated = rebalanced = skipped = False
            moved = 0
            hybrid_sync: WeightSyncOutcome | None = None
            activation_duration: float | None = None
            bytes_saved = 0
            failed: tuple[str, ...] = ()
            if wants and not active and sleeping:
                act = await self.ops.activate(sleeping, version=weight_version, global_step=global_step)
                hybrid_sync, activation_duration, failed = act.sync, act.duration_s, tuple(act.failed)
                if act.activated:
                    activated = True
                    self.activations += 1
                    self._set_state(HybridState.HYBRID_ACTIVE, f"hybrid replicas activated after step "
                                                               f"{global_step}", global_step)
                    started = self.clock()
                    if self.config.dynamic_schedule_enable_rebalance:
                        wanted, how = self._policy.request_rebalance(global_step, self.ctx)
                        if wanted:
                            count = await self.ops.rebalance(global_step, requested=how)
                            rebalanced, moved = count is not None, count or 0
                    self._last_activation_s = act.duration_s + (self.clock() - started)
                    self.ctx.last_activate_duration_s += self._last_activation_s
            elif new_version and not active and (behind := self._behind(sleeping, weight_version)):
                skipped = True
                bytes_saved = self.weights.model_bytes() * len(behind)
                self.bytes_saved_total += bytes_saved
                self.emit(EventType.WEIGHT_SYNC_SKIPPED, global_step=global_step, weight_version=weight_version,
                          reason="hybrid replicas stay inactive; their weight sync is skipped",
                          attributes={"bytes_saved": bytes_saved, "replicas": len(behind),
                                      "replica_ids": list(behind)})
            if self.enabled:
                self._policy.update_after_step(global_step, self.ctx)
            # verl resets the cycle's switch timing once update_after_step has consumed it
            self.ctx.last_activate_duration_s = self.ctx.last_deactivate_duration_s = 0.0
            self.last_completed_step = global_step
            self.next_call = StepCall.BEGIN_TRAINING_STEP
            bytes_sent = sum(s.bytes_sent for s in (standalone_sync, hybrid_sync) if s is not None)
            self._complete = CompleteResult(
                global_step, standalone_sync, activated, skipped, hybrid_sync, bytes_sent, bytes_saved, rebalanced,
                self._ratio() or 0.0, self.hybrid_state, self.next_call, activation_duration, failed, moved)
            self._phase(global_step, "complete", activated=activated, hybrid_sync_skipped=skipped,
                        bytes_saved=bytes_saved, rebalanced=rebalanced, rebalanced_requests=moved,
                        deactivate_ratio=self._ratio())
            return self._complete

    async def release_out_of_band(self, reason: str) -> ReleaseResult | None:
        """Release serving hybrid replicas outside a step (e.g. before trainer-side validation).

        Goes through the same ordered deactivation and state machine, so the
        next step sees the hybrid pool as released and does not release it
        twice. Allowed only between steps; returns None when nothing serves.
        """
        async with self._lock:
            self._expect(StepCall.BEGIN_TRAINING_STEP, "release_out_of_band")
            if not self.is_hybrid_active:
                return None
            result = await self.ops.deactivate(self._serving_hybrid(), global_step=None)
            self.ctx.last_deactivate_duration_s += result.duration_s
            self.deactivations += 1
            self._set_state(HybridState.STANDALONE_ONLY, f"released outside a step: {reason}", None)
            step = self.last_completed_step if self.last_completed_step is not None else 0
            return ReleaseResult(step, result.released, tuple(result.failed), result.duration_s,
                                 result.aborted_requests, False, self.hybrid_state, self.next_call)

    # --- state ---

    def scheduler_state(self) -> SchedulerState:
        hybrid_ids = tuple(r.replica_id for r in self.registry.replicas(kind=ReplicaKind.HYBRID)
                           if r.state is not S.REMOVED)
        cost = self._policy.attribute("switch_cost_s")
        per_sample = self._policy.attribute("per_sample_time_s")
        return SchedulerState(
            self.enabled, self.hybrid_state, self.config.dynamic_schedule_policy, self._policy.parameters(),
            self._ratio(), cost, per_sample, self.next_call, self.current_step, self.activations,
            self.deactivations, self.config.only_hybrid, self.config.dynamic_schedule_enable_rebalance,
            self.ctx.last_activate_duration_s, self.ctx.last_deactivate_duration_s, hybrid_ids,
            self.bytes_saved_total)

    def to_document(self) -> state_pb2.SchedulerDocument:
        """Everything needed to resume after a restart (the registry persists itself)."""
        def answer(value: BeginDecision | ReleaseResult | CompleteResult | None) -> Any:
            return value.to_document() if value is not None else None

        return state_pb2.SchedulerDocument(
            hybrid_state=self.hybrid_state.value, next_call=self.next_call.value, current_step=self.current_step or 0,
            last_completed_step=self.last_completed_step, weight_version=self.weight_version or 0,
            activations=self.activations, deactivations=self.deactivations,
            bytes_saved_total=self.bytes_saved_total, ctx=self.ctx.to_document(),
            outcome=self._outcome.to_document(), base_version=self._base_version, fed_step=self._fed_step,
            begin=answer(self._begin), release=answer(self._release), complete=answer(self._complete),
            policy=to_struct(self._policy.state_dict()), last_activation_s=self._last_activation_s)

    def restore(self, doc: state_pb2.SchedulerDocument) -> None:
        """Resume from ``doc`` (:meth:`to_document`). Steps count from 1, so a current step of 0 is "none
        yet"; the weight version is the last completed step's, so it is "none yet" before one completed."""
        completed = doc.HasField("last_completed_step")
        self.hybrid_state = HybridState(doc.hybrid_state)
        self.next_call = StepCall(doc.next_call)
        self.current_step = doc.current_step or None
        self.last_completed_step = doc.last_completed_step if completed else None
        self.weight_version = doc.weight_version if completed else None
        self.activations = doc.activations
        self.deactivations = doc.deactivations
        self.bytes_saved_total = doc.bytes_saved_total
        self.ctx = DynamicScheduleContext.from_document(doc.ctx)
        self._outcome = StepOutcome.from_document(doc.outcome)
        self._base_version = doc.base_version if doc.HasField("base_version") else None
        self._fed_step = doc.fed_step if doc.HasField("fed_step") else None
        self._begin = BeginDecision.from_document(doc.begin) if doc.HasField("begin") else None
        self._release = ReleaseResult.from_document(doc.release) if doc.HasField("release") else None
        self._complete = CompleteResult.from_document(doc.complete) if doc.HasField("complete") else None
        self._policy.load_state_dict(from_struct(doc.policy))
        self._last_activation_s = doc.last_activation_s

    # --- internals ---

    def _behind(self, ids: list[str], version: int) -> list[str]:
        return [rid for rid in ids if self.registry.get(rid).weight_version < version]

    def _expect(self, call: StepCall, called: str | None = None) -> None:
        if self.next_call is not call:
            raise OutOfOrder(called or call.label, self.next_call.label,
                             None if self.next_call is StepCall.BEGIN_TRAINING_STEP else self.current_step)

    def _check_current(self, global_step: int) -> None:
        if global_step != self.current_step:
            raise InvalidArgumentError(f"global_step {global_step} is not the current step {self.current_step}")

    def _apply_report(self, report: StepReport) -> None:
        ctx = self.ctx
        ctx.required_samples = report.required_samples or self.config.required_samples
        ctx.trigger_parameter_sync_step = (report.trigger_parameter_sync_step
                                           or self.config.trigger_parameter_sync_step)
        ctx.total_generated_samples = report.total_generated_samples
        ctx.expected_samples = report.expected_samples
        ctx.buffer_samples = float(report.buffer_samples)
        ctx.step_wait_times = [float(t) for t in report.step_wait_times]
        ctx.step_wait_samples = [int(n) for n in report.step_wait_samples]
        ctx.only_hybrid = self.config.only_hybrid

    def _feed_metrics(self, report: StepReport, global_step: int, version: int, new_version: bool) -> None:
        if self.metrics is None or self._fed_step == global_step:
            return
        self._fed_step = global_step
        self.metrics.add_micro_step(timing_raw=report.timing_raw, allocated_s=report.train_allocated_time_s,
                                    compute_s=report.train_compute_time_s, queue_size=report.queue_size,
                                    step_generated_samples=report.step_generated_samples,
                                    rollout_history=report.rollout_concurrency, now=self.clock())
        if new_version:
            self.metrics.close_cycle(global_step=global_step, weight_version=version, now=self.clock())

    def _serving_hybrid(self) -> list[str]:
        return [r.replica_id for r in self.registry.replicas(kind=ReplicaKind.HYBRID, states=HOLDING)]

    def _reconcile(self, global_step: int) -> None:
        """Align the hybrid state with the registry (replicas may have failed or re-registered).

        A hybrid replica still SYNCING here belongs to an activation that was
        interrupted (no sync runs between steps): it goes back to SLEEPING, and
        its version is unchanged, so the next activation syncs it again.
        """
        for record in self.registry.replicas(kind=ReplicaKind.HYBRID, states=[S.SYNCING]):
            self.registry.transition(record.replica_id, S.SLEEPING, "activation was interrupted",
                                     global_step=global_step)
        serving = bool(self._serving_hybrid())
        if serving and not self.is_hybrid_active:
            self._set_state(HybridState.HYBRID_ACTIVE, "hybrid replicas found serving", global_step)
        elif not serving and self.is_hybrid_active:
            self._set_state(HybridState.STANDALONE_ONLY, "no hybrid replica serves any more", global_step)

    def _set_state(self, state: HybridState, reason: str, global_step: int | None) -> None:
        if state is self.hybrid_state:
            return
        previous, self.hybrid_state = self.hybrid_state, state
        self.emit(EventType.CONTROLLER_STATE_CHANGED, from_state=previous.proto_name, to_state=state.proto_name,
                  reason=reason, global_step=global_step)

    def _ratio(self) -> float | None:
        ratio = self._policy.attribute("deactivate_ratio")
        return None if ratio is None else float(ratio)

    def _phase(self, global_step: int, phase: str, **attributes: Any) -> None:
        self.emit(EventType.STEP_PHASE, global_step=global_step, reason=f"{phase} of step {global_step}",
                  attributes={"phase": phase, **{k: v for k, v in attributes.items() if v is not None}})
