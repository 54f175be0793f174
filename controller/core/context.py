"""``DynamicScheduleContext``: what a scheduling policy sees at each step.

The fields and their meaning are exactly those of the reference's
``DynamicScheduleContext`` (section 6, step 4 of
``dynamic-resource-scheduling.md``), so a policy written against the
reference's documented API runs unchanged. ``step_required_samples`` is
derived (``required_samples x trigger_parameter_sync_step``) and therefore a
read-only property that can never disagree with its inputs.

The controller fills the context from the trainer's step reports and from its
own measurements (the two ``last_*_duration_s`` fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class DynamicScheduleContext:
    """Inputs of the policy methods; see the reference's field table."""

    required_samples: int = 0
    """Minimum samples per collection (``ppo_mini_batch_size x require_batches``)."""
    trigger_parameter_sync_step: int = 1
    """Collections per weight-sync step."""
    total_generated_samples: int = 0
    """Cumulative rollout samples since training began."""
    expected_samples: int = 0
    """Theoretical samples needed up to the current sync step."""
    buffer_samples: int = 0
    """Allowed buffer headroom (``expected_samples x staleness_threshold``)."""
    step_wait_times: list[float] = dataclasses.field(default_factory=list)
    """Per-collection wait times within the latest step, in seconds."""
    step_wait_samples: list[int] = dataclasses.field(default_factory=list)
    """Per-collection samples that really had to be waited on, parallel to ``step_wait_times``."""
    only_hybrid: bool = False
    """True when there are no standalone replicas."""
    last_activate_duration_s: float = 0.0
    """Duration of the last activation (weight sync + onload), seconds."""
    last_deactivate_duration_s: float = 0.0
    """Duration of the last deactivation (offload), seconds."""

    @property
    def step_required_samples(self) -> int:
        """Samples expected in one weight-sync cycle: ``required_samples x trigger_parameter_sync_step``."""
        return self.required_samples * self.trigger_parameter_sync_step

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for persistence and GetSchedulerState)."""
        data = dataclasses.asdict(self)
        data["step_wait_times"] = list(self.step_wait_times)
        data["step_wait_samples"] = list(self.step_wait_samples)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DynamicScheduleContext:
        """Inverse of :meth:`to_dict`; unknown keys (e.g. the derived one) are ignored."""
        names = {field.name for field in dataclasses.fields(cls)}
        ctx = cls(**{key: value for key, value in data.items() if key in names})
        ctx.step_wait_times = [float(v) for v in ctx.step_wait_times]
        ctx.step_wait_samples = [int(v) for v in ctx.step_wait_samples]
        return ctx
