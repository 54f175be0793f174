"""``fixed_ratio``: ``default`` without adaptation or cost gate (reference section 3.3).

``deactivate_ratio`` stays at its configured value (any value in [0, 1]),
``update_after_step`` does nothing and ``should_activate_after_step`` is the
pure gap check ``expected_samples + buffer_samples - total_generated_samples
> 0``. Unlike the reference, it is registered on a plain import of
``controller.core.policies``. The per-sample and switch-cost estimates are
still kept up to date, for GetSchedulerState.
"""

from __future__ import annotations

from ..context import DynamicScheduleContext
from .default import DefaultDynamicSchedulePolicy
from .registry import register_policy


@register_policy("fixed_ratio")
class FixedRatioDynamicSchedulePolicy(DefaultDynamicSchedulePolicy):
    """Fixed ``deactivate_ratio``; activate whenever generation lags."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False) -> None:
        super().__init__(deactivate_ratio, only_hybrid, min_ratio=0.0, max_ratio=1.0)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        self._refresh_rate(global_steps, ctx)
        self.last_gap = self.gap(ctx)
        return self.last_gap > 0

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        self._refresh_rate(global_steps, ctx)
        self.last_adaptation = "disabled (fixed_ratio)"
