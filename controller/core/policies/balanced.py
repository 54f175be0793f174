"""``balanced``: ``default`` plus a supply check that keeps hybrids training when standalone keeps up.

The reference's key optimisation is that hybrid replicas "skip rollout
entirely" when standalone capacity is sufficient. ``default`` decides that
with verl's gap ``ratio x step_required - (generated - expected)``: it asks
whether the surplus left in the queue covers the next deactivation wait, not
whether the standalone replicas will produce the next cycle's samples in time,
so the hybrids are activated - and pay a full switch (hybrid weight sync, wake,
later abort and sleep) - on workloads where the standalone replicas alone
would have fed the trainer.

``balanced`` keeps ``default``'s adaptive deactivation threshold (the same
ratio rule, bounds and cost/benefit gate) and adds a supply estimate to the
activation decision, from signals the context already carries:

* ``queued = total_generated_samples - expected_samples``: samples left in the
  queue after this step (everything generated minus everything consumed);
* when the hybrids served during this step, standalone production while the
  trainer trained: ``total_generated_samples`` at completion minus the count
  at release, which is ``buffered_samples + expected_samples -
  step_required_samples`` (the queue at release plus all samples consumed
  before this step);
* when they did not, whether the trainer had to wait for samples
  (``step_wait_times``) longer than one switch costs.

It activates only when ``default`` would **and** the standalone replicas are
predicted to fall short: after a step with hybrids serving, when ``queued +
standalone production < (1 + supply_margin) x step_required_samples`` or
``queued < required_samples``; after a step without them, when the trainer
waited longer than the measured switch cost (``switch_cost_s``) or the queue
cannot cover the next mini-batch. A wrong "standalone suffices" costs at most
one step's wait before it is corrected. ``supply_margin`` (default 0.3)
is the safety factor of the prediction: on the simulator's sweep (``rollmesh
simulate --scenario reference-32gpu --compare``) 0.1 already beat ``default``
on average but lost up to 0.9% on some workloads; 0.3 lost on none (two
trace seeds). ``decrease`` is ``default``'s ratio decrement (0.02); the
sweep found larger values worse, so it is a parameter only for experiments.

Use it where standalone capacity is close to or above what the trainer
consumes (large standalone pools, slow trainers, short responses); where the
trainer always outruns the standalone pool it behaves exactly like ``default``.
Samples dropped by a full queue make ``queued`` an over-estimate; the queue
bound is twice the staleness budget, so drops are rare.
"""

from __future__ import annotations

from typing import Any

from ..context import DynamicScheduleContext
from ..errors import PolicyError
from .default import DefaultDynamicSchedulePolicy
from .registry import register_policy


@register_policy("balanced")
class BalancedDynamicSchedulePolicy(DefaultDynamicSchedulePolicy):
    """``default`` that leaves hybrids asleep while standalone supply covers the next step."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, *, min_ratio: float = 0.05,
                 max_ratio: float = 1.0, supply_margin: float = 0.3, decrease: float = 0.02) -> None:
        super().__init__(deactivate_ratio, only_hybrid, min_ratio=min_ratio, max_ratio=max_ratio)
        if not 0.0 <= supply_margin <= 1.0:
            raise PolicyError(f"supply_margin must be in [0, 1], got {supply_margin}")
        if not 0.0 < decrease <= 0.2:
            raise PolicyError(f"decrease must be in (0, 0.2], got {decrease}")
        self.supply_margin = float(supply_margin)
        self.DECREASE = float(decrease)
        self.last_supply_check = "none"

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        wants = super().should_activate_after_step(global_steps, is_hybrid_active, ctx)
        if not wants or self.only_hybrid:
            return wants
        return self.standalone_falls_short(global_steps, ctx)

    def standalone_falls_short(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """True when the standalone replicas alone are predicted not to feed the next step."""
        step_samples = ctx.step_required_samples
        queued = ctx.total_generated_samples - ctx.expected_samples
        if queued < ctx.required_samples:
            self.last_supply_check = f"queue {queued} < one mini-batch ({ctx.required_samples})"
            return True
        outcome = self._outcome
        if outcome is not None and outcome.global_step == global_steps and outcome.deactivated:
            at_release = outcome.buffered_samples + ctx.expected_samples - step_samples
            standalone = max(0, ctx.total_generated_samples - at_release)
            short = queued + standalone < (1.0 + self.supply_margin) * step_samples
            self.last_supply_check = (f"queued {queued} + standalone {standalone} "
                                      f"{'<' if short else '>='} {1.0 + self.supply_margin:g} x {step_samples}")
            return short
        waited = sum(ctx.step_wait_times)
        short = waited > self.switch_cost_s
        self.last_supply_check = (f"trainer waited {waited:.1f} s {'>' if short else '<='} "
                                  f"switch cost {self.switch_cost_s:.1f} s")
        return short

    def parameters(self) -> dict[str, Any]:
        return {**super().parameters(), "supply_margin": self.supply_margin, "decrease": self.DECREASE}
