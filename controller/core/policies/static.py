"""``static_fully_async``: the original fully-async behaviour (reference section 3.2).

Hybrid replicas are released at the start of every step without waiting and
never re-activated, so trainer GPUs always train - the same as running without
``use_dynamic_resource_scheduling``. Useful as a baseline and as the colocated
fallback.
"""

from __future__ import annotations

from typing import Any

from ..context import DynamicScheduleContext
from .base import DynamicSchedulePolicyBase
from .registry import register_policy


@register_policy("static_fully_async")
class StaticFullyAsyncPolicy(DynamicSchedulePolicyBase):
    """Deactivate immediately whenever active; never activate."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False) -> None:
        # Kept for reporting only; this policy never waits. verl forces 1.0 with only_hybrid.
        self.only_hybrid = bool(only_hybrid)
        self.deactivate_ratio = 1.0 if self.only_hybrid else float(deactivate_ratio)

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool,
                          ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return 0

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return False

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        return None

    def parameters(self) -> dict[str, Any]:
        return {"deactivate_ratio": self.deactivate_ratio, "only_hybrid": self.only_hybrid}
