"""One simulated training run: the real controller core driven by a simulated trainer.

:func:`simulate_run` builds, for one :class:`~simulator.scenario.RunSpec`, the
controller core's registry, :class:`~controller.core.hybrid.DynamicResourceController`
(with the policy the scenario names, created by the core's registry) and
:class:`~controller.core.metrics.CycleMetrics`, wires them to the simulated
ports, and runs the trainer loop of ``trainer_agent/driver/loop.py`` on the
virtual clock. Per global step ``g``:

1. ``begin_step(g, report)``; on a deactivate answer, wait (bounded by
   ``wait_timeout_s``) until the queue holds ``wait_samples``, then
   ``release_hybrid`` (remove -> abort -> sleep, by the core);
2. ``trigger_parameter_sync_step`` mini-batches: take ``required_samples``
   (the wait and the waited-on samples become ``step_wait_times`` /
   ``step_wait_samples``), train for the trainer model's compute time;
3. close the rollout window (``reset_staleness``) and
   ``complete_step(g, g, report)``: the core syncs weights, feeds the metrics
   and runs policy points 3-5, possibly activating the hybrid replicas.

The report carries what the real trainer agent reports, in verl's unit (a
sample is one prompt with its ``n`` responses): cumulative
``expected_samples = required x trigger x g``, ``buffer_samples = required x
trigger x staleness_threshold``, the queue's ``generated`` count, timings and
the rollout concurrency history.

Only-hybrid (colocated) runs - ``rollout_gpus: 0`` with ``dynamic: true`` -
set the policy's ``only_hybrid`` and start with the hybrid replicas serving:
nothing else could generate the first step's samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from mesh_runtime import samples

from controller.core import (
    CycleMetrics,
    DynamicResourceController,
    EventLog,
    ReplicaKind,
    ReplicaRegistry,
    ReplicaSpec,
    ReplicaState,
    SchedulingConfig,
    StepReport,
)
from controller.core.metrics import (
    MQ_SIZE,
    RESOURCE_UTILIZATION,
    ROLLOUT_UTILIZATION,
    TRAIN_UTILIZATION,
)
from controller.core.policies import DynamicSchedulePolicyBase

from .ports import SimReplicas, SimRouting, SimWeights
from .scenario import RunSpec, Scenario, ScenarioError
from .vloop import run_virtual
from .world import World

COMPUTE_SPLIT = (("reward", 0.03), ("old_log_prob", 0.14), ("ref", 0.14), ("adv", 0.01), ("update_actor", 0.68))
"""How one mini-batch's compute time is reported over the reference's ``timing_raw`` keys."""


@dataclasses.dataclass
class StepRecord:
    """What one global step did, on the virtual clock."""

    step: int
    start_s: float
    end_s: float
    deactivated: bool
    wait_samples: int
    waited_s: float
    release_s: float
    aborted_requests: int
    stall_s: float
    stalled_samples: int
    train_s: float
    complete_s: float
    activated: bool
    hybrid_sync_skipped: bool
    deactivate_ratio: float | None
    rebalanced: bool
    rebalanced_requests: int
    mq_size: int
    generated: int
    train_utilization: float
    rollout_utilization: float
    resource_utilization: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["duration_s"] = self.duration_s
        return data


@dataclasses.dataclass
class RunResult:
    """The outcome of one simulated run."""

    name: str
    policy: str
    dynamic: bool
    train_gpus: int
    rollout_gpus: int
    steps: list[StepRecord]
    total_time_s: float
    generated: int
    consumed: int
    dropped: int
    activations: int
    deactivations: int
    queue_cap: int
    """The most samples that can stay queued after a step: ``int(step_samples x staleness_threshold)``."""
    controller: DynamicResourceController | None = dataclasses.field(default=None, repr=False)
    calls: list[tuple[float, str, tuple[str, ...]]] = dataclasses.field(default_factory=list, repr=False)

    def series(self, name: str) -> list[float]:
        return [float(getattr(s, name)) for s in self.steps]

    def mean(self, name: str, skip: int = 0) -> float:
        values = self.series(name)[skip:]
        return sum(values) / len(values) if values else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "policy": self.policy, "dynamic": self.dynamic,
                "train_gpus": self.train_gpus, "rollout_gpus": self.rollout_gpus,
                "total_time_s": self.total_time_s, "generated": self.generated, "consumed": self.consumed,
                "dropped": self.dropped, "activations": self.activations, "deactivations": self.deactivations,
                "queue_cap": self.queue_cap, "steps": [s.to_dict() for s in self.steps]}


def train_time_s(scenario: Scenario, tokens: int, gpus: int) -> float:
    """Compute time of one mini-batch of ``tokens`` (prompt + response) on ``gpus`` trainer GPUs."""
    t = scenario.trainer
    return t.overhead_s + tokens / 1e6 * t.gpu_seconds_per_mtoken / gpus ** t.scaling_exponent


def build_world(scenario: Scenario, spec: RunSpec, seed: int) -> tuple[World, ReplicaRegistry, EventLog]:
    """The world and the core's registry with one record per simulated replica."""
    world = World(scenario.workload, scenario.engine, seed)
    events = EventLog(lambda: world.now, max_events=2000)
    registry = ReplicaRegistry(clock=lambda: world.now, emit=events.append, lease_ttl_s=1e12)
    per_replica, per_node = scenario.engine.gpus_per_replica, scenario.gpus_per_node
    pools = [("r", spec.rollout_gpus, ReplicaKind.STANDALONE)]
    if spec.dynamic:
        pools.append(("t", spec.train_gpus, ReplicaKind.HYBRID))
    only_hybrid = spec.dynamic and spec.rollout_gpus == 0
    for prefix, gpus, kind in pools:
        nodes: dict[str, list[ReplicaSpec]] = {}
        for index in range(gpus // per_replica):
            node = f"{prefix}node{index * per_replica // per_node}"
            rid = f"{'hybrid' if kind is ReplicaKind.HYBRID else 'standalone'}-{index}"
            hybrid = kind is ReplicaKind.HYBRID
            serving = not hybrid or only_hybrid
            state = ReplicaState.ACTIVE if serving else ReplicaState.SLEEPING
            nodes.setdefault(node, []).append(ReplicaSpec(rid, kind, state, initial=not hybrid))
            world.add_replica(rid, node, hybrid=hybrid, routed=serving)
        for node, replicas in nodes.items():
            registry.register_node(node, f"{node}.sim:0", replicas=replicas)
    return world, registry, events


def scheduling_config(scenario: Scenario, spec: RunSpec, policy: str | None) -> SchedulingConfig:
    w = scenario.workload
    fields = dict(scenario.scheduling)
    fields.update(use_dynamic_resource_scheduling=spec.dynamic, only_hybrid=spec.dynamic and spec.rollout_gpus == 0,
                  ppo_mini_batch_size=w.ppo_mini_batch_size)
    if policy is not None:
        fields["dynamic_schedule_policy"] = policy
    elif spec.policy is not None:
        fields["dynamic_schedule_policy"] = spec.policy
    return SchedulingConfig(**fields)


def simulate_run(scenario: Scenario, spec: RunSpec, *, steps: int | None = None, seed: int | None = None,
                 policy: str | None = None, policy_instance: DynamicSchedulePolicyBase | None = None) -> RunResult:
    """Simulate ``spec`` of ``scenario`` for ``steps`` global steps (default: the scenario's)."""
    seed = scenario.seed if seed is None else seed
    steps = scenario.steps if steps is None else steps
    world, registry, events = build_world(scenario, spec, seed)
    calls: list[tuple[float, str, tuple[str, ...]]] = []
    routing = SimRouting(world, scenario.transitions, calls)
    replicas = SimReplicas(world, scenario.transitions, calls)
    weights = SimWeights(world, scenario.transitions, calls)
    w = scenario.workload
    metrics = CycleMetrics(hybrid_gpus=spec.train_gpus, standalone_gpus=spec.rollout_gpus,
                           concurrent_samples_per_replica=scenario.engine.concurrent_samples_per_replica,
                           max_required_samples=w.max_required_completions)
    config = scheduling_config(scenario, spec, policy)
    try:
        controller = DynamicResourceController(config, registry=registry, routing=routing, replicas=replicas,
                                               weights=weights, clock=lambda: world.now, emit=events.append,
                                               metrics=metrics, policy=policy_instance)
    except Exception as err:  # a policy that cannot be created is a scenario error
        raise ScenarioError("scheduling.dynamic_schedule_policy", str(err)) from None
    trainer = SimTrainer(scenario, spec, world, controller, metrics)
    records = run_virtual(world, trainer.run(steps))
    return RunResult(name=spec.name, policy=config.dynamic_schedule_policy if spec.dynamic else "static",
                     dynamic=spec.dynamic, train_gpus=spec.train_gpus, rollout_gpus=spec.rollout_gpus,
                     steps=records, total_time_s=records[-1].end_s if records else 0.0,
                     generated=world.generated, consumed=world.consumed, dropped=world.dropped,
                     activations=controller.activations, deactivations=controller.deactivations,
                     queue_cap=int(w.buffer_samples), controller=controller, calls=calls)


class SimTrainer:
    """The trainer agent's fully-async loop (``trainer_agent/driver/loop.py``) on the virtual clock."""

    def __init__(self, scenario: Scenario, spec: RunSpec, world: World, controller: DynamicResourceController,
                 metrics: CycleMetrics) -> None:
        self.scenario, self.spec, self.world = scenario, spec, world
        self.ctl, self.metrics = controller, metrics
        self.w = scenario.workload
        self.last_sync_s = 0.0

    def queued(self) -> int:
        """Samples (prompt groups) in the queue; the world queues whole groups."""
        return self.world.queue_size // self.w.n

    def report(self, step: int, **extra: Any) -> StepReport:
        w, world = self.w, self.world
        return StepReport(required_samples=w.required_samples,
                          trigger_parameter_sync_step=w.trigger_parameter_sync_step,
                          total_generated_samples=world.generated // w.n,
                          expected_samples=samples.expected_samples(w.step_samples, step),
                          buffer_samples=w.buffer_samples, queue_size=self.queued(), **extra)

    async def wait_for(self, count: int, timeout_s: float) -> tuple[float, bool]:
        """Wait until the queue holds ``count`` samples (groups)."""
        start = self.world.now
        try:
            await asyncio.wait_for(self.world.wait_queue(count * self.w.n), timeout_s)
        except TimeoutError:
            return self.world.now - start, True
        return self.world.now - start, False

    async def run(self, steps: int) -> list[StepRecord]:
        self.world.start()
        return [await self.step(g) for g in range(1, steps + 1)]

    async def step(self, g: int) -> StepRecord:
        world, ctl, w = self.world, self.ctl, self.w
        start = world.now
        begin = await ctl.begin_step(g, self.report(g))
        waited, expired, release_s, aborted = 0.0, False, 0.0, 0
        if begin.deactivate:
            waited, expired = await self.wait_for(begin.wait_samples, begin.wait_timeout_s)
            t0 = world.now
            released = await ctl.release_hybrid(g, self.queued(), waited, expired)
            release_s, aborted = world.now - t0, released.aborted_requests
        alloc0 = world.now
        wait_times: list[float] = []
        wait_samples: list[int] = []
        timing = {key: 0.0 for key, _ in COMPUTE_SPLIT}
        timing["step"] = 0.0
        for _ in range(w.trigger_parameter_sync_step):
            size0, t0 = self.queued(), world.now
            await world.wait_queue(w.required_completions)
            wait_times.append(world.now - t0)
            wait_samples.append(samples.wait_samples(w.required_samples, size0))
            tokens = world.take(w.required_completions)
            compute = train_time_s(self.scenario, tokens, self.spec.train_gpus)
            await asyncio.sleep(compute)
            timing["step"] += compute
            for key, share in COMPUTE_SPLIT:
                timing[key] += compute * share
        allocated = world.now - alloc0
        train_s = timing["step"]
        timing["wait_for_enough_samples"] = waited   # the reference's key: the wait before the release
        timing["param_sync"] = self.last_sync_s
        window, rollout = world.reset_staleness()
        report = self.report(g, step_wait_times=wait_times, step_wait_samples=wait_samples, timing_raw=timing,
                             train_compute_time_s=train_s, train_allocated_time_s=allocated,
                             step_generated_samples=int(rollout["fully_async/rollouter/step_generated_samples"]),
                             rollout_concurrency=window, samples_consumed=w.step_samples)
        mq_size = world.queue_size
        t0 = world.now
        done = await ctl.complete_step(g, g, report)
        self.last_sync_s = world.now - t0
        cycle = self.metrics.closed[-1].values if self.metrics.closed else {}
        return StepRecord(
            step=g, start_s=start, end_s=world.now, deactivated=begin.deactivate, wait_samples=begin.wait_samples,
            waited_s=waited, release_s=release_s, aborted_requests=aborted, stall_s=sum(wait_times),
            stalled_samples=sum(wait_samples),
            train_s=train_s, complete_s=self.last_sync_s, activated=done.hybrid_activated,
            hybrid_sync_skipped=done.hybrid_sync_skipped, deactivate_ratio=done.deactivate_ratio,
            rebalanced=done.rebalanced, rebalanced_requests=done.rebalanced_requests,
            mq_size=int(cycle.get(MQ_SIZE, mq_size)), generated=world.generated,
            train_utilization=cycle.get(TRAIN_UTILIZATION, 0.0),
            rollout_utilization=cycle.get(ROLLOUT_UTILIZATION, 0.0),
            resource_utilization=cycle.get(RESOURCE_UTILIZATION, 0.0))
