"""``fixed_ratio``: a fixed ``deactivate_ratio`` and a pure gap check, decided as verl's code does.

verl's ``FixedRatioDynamicSchedulePolicy`` (``fixed_ratio_policy.py``):

* with ``only_hybrid`` the ratio is forced to 1.0 and activation is always on;
* ``deactivate_wait_samples`` is ``int(step_required_samples x deactivate_ratio)``;
* ``should_activate_after_step``: ``total_generated_samples - expected_samples
  < deactivate_ratio x step_required_samples`` (no cost gate);
* ``update_after_step`` leaves the ratio alone;
* ``request_rebalance`` asks for the rebalance (verl's goes through its rollouter).

Unlike verl, it is registered on a plain import of ``controller.core.policies``
(the reference's registration note does not apply). The per-sample and
switch-cost estimates are kept up to date for GetSchedulerState only; they
never enter a decision.
"""

from __future__ import annotations

from ..context import DynamicScheduleContext
from .default import DefaultDynamicSchedulePolicy
from .registry import register_policy


@register_policy("fixed_ratio")
class FixedRatioDynamicSchedulePolicy(DefaultDynamicSchedulePolicy):
    """Fixed ``deactivate_ratio``; activate whenever generation's surplus is below the ratio's share."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False) -> None:
        super().__init__(deactivate_ratio, only_hybrid, min_ratio=0.0, max_ratio=1.0)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        self._refresh_rate(global_steps, ctx)
        if self.only_hybrid:
            return True
        self.last_gap = self.gap(ctx)
        surplus = ctx.total_generated_samples - ctx.expected_samples
        return surplus < self.deactivate_ratio * ctx.step_required_samples

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        self._refresh_rate(global_steps, ctx)
        if global_steps > 0 and not self.only_hybrid:
            self._record_switch_overhead(ctx)
        self.last_adaptation = "disabled (fixed_ratio)"
