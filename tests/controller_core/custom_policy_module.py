"""A tiny policy module loaded by import path in the tests (not registered by name)."""

from controller.core.policies import DynamicSchedulePolicyBase


class TinyPolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False, wait: int = 7) -> None:
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid
        self.wait = wait

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return self.wait

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return True


class NotAPolicy:
    pass
