"""The oracle: the best hybrid schedule in hindsight for one workload trace, found by search.

A schedule fixes, per training step, the deactivation threshold (as a ratio of
``step_required_samples``) and whether the hybrid replicas are activated after
the step. :class:`ScheduledPolicy` replays such a schedule through the real
controller core (it is an ordinary policy); the trace of response lengths is
the same in every replay (the simulator draws lengths by submission index),
so the search compares schedules on identical work.

Search (:func:`search_oracle`):

1. every constant schedule: ratio in ``RATIOS`` with activation on, plus
   "never activate" (the static fully-async schedule);
2. coordinate descent from the best one over ``SEGMENTS`` equal segments of
   the run: each segment's ratio moves by +-``STEP`` and its activation flips
   while that makes the whole run shorter (``PASSES`` passes at most).

The result bounds from above what a policy could reach *within this schedule
family*; the sweep reports each policy's time as a fraction of it
(``oracle time / policy time``; 1.0 = as good as the oracle).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from controller.core.context import DynamicScheduleContext
from controller.core.policies import DynamicSchedulePolicyBase

RATIOS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SEGMENTS = 4
STEP = 0.1
PASSES = 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-segment ratios and activation flags over ``steps`` steps."""

    ratios: tuple[float, ...]
    activate: tuple[bool, ...]
    steps: int

    def segment(self, step: int) -> int:
        return min(len(self.ratios) - 1, (max(1, step) - 1) * len(self.ratios) // max(1, self.steps))

    def describe(self) -> str:
        return " | ".join(f"{r:.1f}{'' if a else ' off'}" for r, a in zip(self.ratios, self.activate))

    def to_dict(self) -> dict[str, Any]:
        return {"ratios": list(self.ratios), "activate": list(self.activate), "steps": self.steps}


class ScheduledPolicy(DynamicSchedulePolicyBase):
    """Replays a :class:`Schedule` (an open-loop policy)."""

    def __init__(self, schedule: Schedule, deactivate_ratio: float = 0.5, only_hybrid: bool = False) -> None:
        self.schedule = schedule
        self.only_hybrid = only_hybrid
        self.deactivate_ratio = schedule.ratios[0]
        self._step = 1

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        self._step = global_steps
        self.deactivate_ratio = self.schedule.ratios[self.schedule.segment(global_steps)]
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(self.deactivate_ratio * ctx.step_required_samples)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        # the activation after step g serves step g + 1
        return self.schedule.activate[self.schedule.segment(global_steps + 1)]

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext,
                          reset_prefix_cache: bool = True) -> bool:
        return True


@dataclasses.dataclass
class OracleResult:
    schedule: Schedule
    total_time_s: float
    evaluations: int


def search_oracle(evaluate: Callable[[Schedule], float], steps: int) -> OracleResult:
    """Minimise ``evaluate(schedule)`` (a run's total time) over the schedule family."""
    seen: dict[Schedule, float] = {}

    def cost(schedule: Schedule) -> float:
        if schedule not in seen:
            seen[schedule] = evaluate(schedule)
        return seen[schedule]

    candidates = [Schedule((r,) * SEGMENTS, (True,) * SEGMENTS, steps) for r in RATIOS]
    candidates.append(Schedule((RATIOS[0],) * SEGMENTS, (False,) * SEGMENTS, steps))
    best = min(candidates, key=cost)
    for _ in range(PASSES):
        improved = False
        for k in range(SEGMENTS):
            moves = []
            for delta in (-STEP, STEP):
                ratio = round(best.ratios[k] + delta, 6)
                if 0.0 < ratio <= 1.0:
                    moves.append(dataclasses.replace(best, ratios=best.ratios[:k] + (ratio,) + best.ratios[k + 1:]))
            moves.append(dataclasses.replace(
                best, activate=best.activate[:k] + (not best.activate[k],) + best.activate[k + 1:]))
            for move in moves:
                if cost(move) < cost(best):
                    best, improved = move, True
        if not improved:
            break
    return OracleResult(best, cost(best), len(seen))
