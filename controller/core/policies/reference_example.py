"""``reference_example``: the custom policy of the reference document's section 6, as a named policy.

The reference's example activates on ``total_generated_samples <
expected_samples + buffer_samples`` and waits for ``int(required_samples x
trigger_parameter_sync_step x deactivate_ratio)`` samples before releasing.
This is *not* what verl's built-in ``default`` or ``fixed_ratio`` decide
(their gaps compare the surplus ``generated - expected`` with
``deactivate_ratio x step_required_samples`` and ignore ``buffer_samples``);
rollmesh's built-ins follow verl's code, and this class keeps the document's
formula available under its own name. Its ``request_rebalance`` is the
base no-op, so it is never rebalanced, exactly as in verl.
"""

from __future__ import annotations

from ..context import DynamicScheduleContext
from .base import DynamicSchedulePolicyBase
from .registry import register_policy


@register_policy("reference_example")
class ReferenceExamplePolicy(DynamicSchedulePolicyBase):
    """Fixed ratio; activate while generation lags ``expected + buffer``."""

    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False) -> None:
        self.deactivate_ratio = float(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool,
                          ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.required_samples * ctx.trigger_parameter_sync_step * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return ctx.total_generated_samples < ctx.expected_samples + ctx.buffer_samples
