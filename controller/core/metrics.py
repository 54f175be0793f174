"""The ``dynamic_resource/*`` metrics, exactly as section 4 of the reference defines them.

Formulas (``a`` hybrid GPUs, ``b`` standalone GPUs, ``s`` concurrent samples
per replica, ``maxReq`` max required samples):

* ``train_resource_utilization = sum_i compute_i / sum_i alloc_i`` over the
  cycle's micro fit-steps (a ratio of sums, never a mean of ratios), where
  ``compute_i`` sums the timing keys in :data:`TRAIN_COMPUTE_KEYS` (missing
  keys count 0). The raw sums are ``train_compute_time_s`` and
  ``train_allocated_time_s``.
* ``rollout_resource_utilization = sum_k dt_k * min(cap_k, active_k) /
  sum_k dt_k * cap_k`` with ``cap_k = min(servers_k * s, maxReq)`` held over
  ``[t_k, t_k+1)``; intervals with ``cap_k = 0`` are skipped; 0.0 when no
  weight remains. Seed points recorded before the capacity was known
  (``placeholder=True``, capacity 0) take the first real capacity that
  follows them. The wire format has no such flag, so :class:`CycleMetrics`
  treats the very first point it ever receives as that seed when its
  capacity is 0 (the reference's single init-time seed point); later
  zero-capacity intervals are real and skipped.
* ``resource_utilization = ((1-x) a U_train + (x a + b) U_rollout) / (a + b)``
  with ``x = clip(wait / step, 0, 1)``; ``x = 0`` when no deactivation wait
  happened this cycle.
* ``mq_size`` is the last queue size of the cycle (a snapshot, not a mean);
  ``fully_async/rollouter/step_generated_samples`` the last value of the
  rollouter's per-version counter.

One rollmesh addition, ``fully_async/rollouter/idle_ratio``: the share of the
cycle's rollout window with no active task, summed over *every* idle (pause)
window rather than only the last one (known weakness 15).

A sync cycle is exactly the micro-steps between two weight syncs:
:class:`CycleMetrics` adds each report to the open cycle and closes it when a
sync happens, so the report that ends with the sync belongs to the cycle the
sync closes, and the next report opens the next cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from mesh_runtime.rollout_metrics import (  # noqa: F401 - section 4.2, shared with the trainer's rollouter
    ConcurrencyPoint,
    _capacity_unknown,
    interval_capacities,
    rollout_idle_ratio,
    rollout_resource_utilization,
)
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

TRAIN_COMPUTE_KEYS = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")

TRAIN_UTILIZATION = "dynamic_resource/train_resource_utilization"
ROLLOUT_UTILIZATION = "dynamic_resource/rollout_resource_utilization"
RESOURCE_UTILIZATION = "dynamic_resource/resource_utilization"
MQ_SIZE = "dynamic_resource/mq_size"
TRAIN_COMPUTE_TIME = "dynamic_resource/train_compute_time_s"
TRAIN_ALLOCATED_TIME = "dynamic_resource/train_allocated_time_s"
STEP_GENERATED_SAMPLES = "fully_async/rollouter/step_generated_samples"
ROLLOUTER_IDLE_RATIO = "fully_async/rollouter/idle_ratio"


@dataclasses.dataclass(frozen=True)
class MicroStep:
    """Timing of one micro fit-step: its ``timing_raw`` and its allocated wall-clock time."""

    timing_raw: Mapping[str, float]
    allocated_s: float


def train_compute_time_s(timing_raw: Mapping[str, float]) -> float:
    """``compute_i``: the training-compute keys of one micro-step; missing keys are 0."""
    return float(sum(float(timing_raw.get(key, 0.0)) for key in TRAIN_COMPUTE_KEYS))


def train_allocated_time_s(micro_steps: Iterable[MicroStep]) -> float:
    """``sum_i alloc_i``."""
    return float(sum(step.allocated_s for step in micro_steps))


def train_resource_utilization(micro_steps: Iterable[MicroStep]) -> float:
    """``sum_i compute_i / sum_i alloc_i``; 0.0 when nothing was allocated."""
    steps = list(micro_steps)
    allocated = train_allocated_time_s(steps)
    if allocated <= 0:
        return 0.0
    return sum(train_compute_time_s(step.timing_raw) for step in steps) / allocated


def hybrid_rollout_fraction(wait_s: float, step_s: float) -> float:
    """``x = clip(wait / step, 0, 1)``; 0 when there was no wait or no step time."""
    if wait_s <= 0 or step_s <= 0:
        return 0.0
    return min(max(wait_s / step_s, 0.0), 1.0)


def resource_utilization(wait_s: float, step_s: float, a: float, b: float,
                         u_train: float, u_rollout: float) -> float:
    """Cluster-wide utilization ``((1-x) a U_train + (x a + b) U_rollout) / (a + b)``."""
    if a + b <= 0:
        return 0.0
    x = hybrid_rollout_fraction(wait_s, step_s)
    return ((1 - x) * a * u_train + (x * a + b) * u_rollout) / (a + b)


@dataclasses.dataclass
class ClosedCycle:
    """The metrics of one finished sync cycle (``MetricsCycle`` in observability.proto)."""

    cycle: int
    global_step: int
    weight_version: int
    started_at: float
    ended_at: float
    values: dict[str, float]

    def to_document(self) -> state_pb2.MetricsCycle:
        return state_pb2.MetricsCycle(cycle=self.cycle, global_step=self.global_step,
                                      weight_version=self.weight_version, started_at=self.started_at,
                                      ended_at=self.ended_at, values=self.values)

    @classmethod
    def from_document(cls, doc: state_pb2.MetricsCycle) -> ClosedCycle:
        return cls(cycle=doc.cycle, global_step=doc.global_step, weight_version=doc.weight_version,
                   started_at=doc.started_at, ended_at=doc.ended_at, values=dict(doc.values))


class CycleMetrics:
    """Collects per-micro-step reports and closes a sync cycle at each weight sync."""

    def __init__(self, *, hybrid_gpus: int, standalone_gpus: int, concurrent_samples_per_replica: int,
                 max_required_samples: int, max_cycles: int = 1000, seed_is_placeholder: bool = True) -> None:
        self.hybrid_gpus = hybrid_gpus
        self.standalone_gpus = standalone_gpus
        self.concurrent_samples_per_replica = concurrent_samples_per_replica
        self.max_required_samples = max_required_samples
        self.max_cycles = max_cycles
        self._seeded = not seed_is_placeholder
        self.closed: list[ClosedCycle] = []
        self._next_cycle = 1
        self._reset(started_at=None)

    def _reset(self, started_at: float | None) -> None:
        self._micro_steps: list[MicroStep] = []
        self._compute_s = 0.0
        self._history: list[ConcurrencyPoint] = []
        self._wait_s = 0.0
        self._deactivation_waits = 0
        self._step_s = 0.0
        self._mq_size: int | None = None
        self._step_generated: int | None = None
        self._started_at = started_at

    def add_micro_step(self, *, timing_raw: Mapping[str, float], allocated_s: float,
                       compute_s: float | None = None, queue_size: int | None = None,
                       step_generated_samples: int | None = None,
                       rollout_history: Sequence[ConcurrencyPoint] = (), now: float | None = None) -> None:
        """Add one micro fit-step (or a report summing several) to the open cycle.

        ``compute_s`` overrides the compute time derived from ``timing_raw``
        when the trainer reports it directly (``train_compute_time``).
        """
        if self._started_at is None:
            self._started_at = now
        step = MicroStep(timing_raw=dict(timing_raw), allocated_s=float(allocated_s))
        self._micro_steps.append(step)
        self._compute_s += train_compute_time_s(step.timing_raw) if compute_s is None else float(compute_s)
        self._step_s += float(timing_raw.get("step", 0.0))
        points = list(rollout_history)
        if points and not self._seeded:
            self._seeded = True
            first = points[0]
            if not first.placeholder and _capacity_unknown(first):
                points[0] = dataclasses.replace(first, placeholder=True)
        self._history.extend(points)
        if queue_size is not None:
            self._mq_size = int(queue_size)
        if step_generated_samples is not None:
            self._step_generated = int(step_generated_samples)

    def record_deactivation_wait(self, waited_s: float) -> None:
        """The trainer waited ``waited_s`` (its wait_for_enough_samples) before releasing hybrids."""
        self._wait_s += max(0.0, float(waited_s))
        self._deactivation_waits += 1

    def current_values(self) -> dict[str, float]:
        """The open cycle's metrics as they stand now."""
        allocated = sum(step.allocated_s for step in self._micro_steps)
        u_train = self._compute_s / allocated if allocated > 0 else 0.0
        u_rollout = rollout_resource_utilization(self._history, self.concurrent_samples_per_replica,
                                                 self.max_required_samples)
        wait = self._wait_s if self._deactivation_waits else 0.0
        values = {
            TRAIN_UTILIZATION: u_train,
            TRAIN_COMPUTE_TIME: self._compute_s,
            TRAIN_ALLOCATED_TIME: allocated,
            ROLLOUT_UTILIZATION: u_rollout,
            RESOURCE_UTILIZATION: resource_utilization(wait, self._step_s, self.hybrid_gpus,
                                                       self.standalone_gpus, u_train, u_rollout),
            ROLLOUTER_IDLE_RATIO: rollout_idle_ratio(self._history),
        }
        if self._mq_size is not None:
            values[MQ_SIZE] = float(self._mq_size)
        if self._step_generated is not None:
            values[STEP_GENERATED_SAMPLES] = float(self._step_generated)
        return values

    def close_cycle(self, *, global_step: int, weight_version: int, now: float) -> ClosedCycle:
        """End the open cycle at a weight sync; returns its metrics and opens the next one."""
        closed = ClosedCycle(cycle=self._next_cycle, global_step=global_step, weight_version=weight_version,
                             started_at=self._started_at if self._started_at is not None else now,
                             ended_at=now, values=self.current_values())
        self.closed.append(closed)
        del self.closed[:-self.max_cycles]
        self._next_cycle += 1
        self._reset(started_at=now)
        return closed

    def cycles(self, from_cycle: int = 1, limit: int = 100) -> list[ClosedCycle]:
        """Closed cycles from ``from_cycle`` on, oldest first."""
        return [c for c in self.closed if c.cycle >= from_cycle][:limit]

    def to_document(self) -> state_pb2.MetricsDocument:
        """Closed cycles and the cycle counter (the open cycle restarts empty after a restore)."""
        return state_pb2.MetricsDocument(next_cycle=self._next_cycle, seeded=self._seeded,
                                         closed=[c.to_document() for c in self.closed])

    def restore(self, document: state_pb2.MetricsDocument) -> None:
        self.closed = [ClosedCycle.from_document(c) for c in document.closed]
        self._next_cycle = document.next_cycle if document.HasField("next_cycle") else len(self.closed) + 1
        self._seeded = document.seeded if document.HasField("seeded") else self._seeded
        self._reset(started_at=None)
