"""A policy written only against the reference's documented API (section 6), for the sweep.

It uses nothing but the reference's base class, context fields and registry
decorator, and is selected by import path
(``simulator.example_policy:ReferenceStylePolicy``), showing that such a class
runs unchanged through the real controller core in the simulator.
"""

from controller.core.policies import DynamicScheduleContext, DynamicSchedulePolicyBase


class ReferenceStylePolicy(DynamicSchedulePolicyBase):
    """Fixed ratio; activate whenever generation lags expectation plus buffer."""

    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False):
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.required_samples * ctx.trigger_parameter_sync_step * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return ctx.total_generated_samples < ctx.expected_samples + ctx.buffer_samples
