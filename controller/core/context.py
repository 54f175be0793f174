"""``DynamicScheduleContext``: what a scheduling policy sees at each step.

The fields, their names and their meaning are those of verl's
``DynamicScheduleContext`` (``dynamic_schedule/base.py``) and of the
reference's table (section 6, step 4), so a policy written against either
runs unchanged. ``step_required_samples`` is derived (``required_samples x
trigger_parameter_sync_step``) and therefore a read-only property that can
never disagree with its inputs.

Counts are in samples of one prompt each (with its ``rollout.n`` responses),
as in verl; see :mod:`mesh_runtime.samples`. The controller fills the context
as verl's ``FullyAsyncTrainer`` does: the counters from the trainer's step
reports (``buffer_samples = step_required_samples x staleness_threshold``, a
float, constant over the run), and the two switch durations from its own
measurements, *accumulated* over a sync cycle (every deactivation and
activation of the cycle adds to them) and reset to 0 after
``update_after_step`` has seen them.
"""

from __future__ import annotations

import dataclasses

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2


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
    buffer_samples: float = 0.0
    """Allowed buffer headroom (``step_required_samples x staleness_threshold``, as verl's trainer)."""
    step_wait_times: list[float] = dataclasses.field(default_factory=list)
    """Per-collection wait times within the latest step, in seconds."""
    step_wait_samples: list[int] = dataclasses.field(default_factory=list)
    """Per-collection samples that really had to be waited on, parallel to ``step_wait_times``."""
    only_hybrid: bool = False
    """True when there are no standalone replicas."""
    last_activate_duration_s: float = 0.0
    """Activation time of the current cycle (weight sync + onload + rebalance), seconds; reset after
    ``update_after_step``."""
    last_deactivate_duration_s: float = 0.0
    """Deactivation time of the current cycle (remove + abort + offload), seconds; reset after
    ``update_after_step``."""

    @property
    def step_required_samples(self) -> int:
        """Samples expected in one weight-sync cycle: ``required_samples x trigger_parameter_sync_step``."""
        return self.required_samples * self.trigger_parameter_sync_step

    def to_document(self) -> state_pb2.ScheduleContext:
        """The context as the scheduler's document keeps it."""
        return state_pb2.ScheduleContext(
            required_samples=self.required_samples, trigger_parameter_sync_step=self.trigger_parameter_sync_step,
            total_generated_samples=self.total_generated_samples, expected_samples=self.expected_samples,
            buffer_samples=self.buffer_samples, step_wait_times=self.step_wait_times,
            step_wait_samples=self.step_wait_samples, only_hybrid=self.only_hybrid,
            last_activate_duration_s=self.last_activate_duration_s,
            last_deactivate_duration_s=self.last_deactivate_duration_s)

    @classmethod
    def from_document(cls, doc: state_pb2.ScheduleContext) -> DynamicScheduleContext:
        return cls(
            required_samples=doc.required_samples, trigger_parameter_sync_step=doc.trigger_parameter_sync_step,
            total_generated_samples=doc.total_generated_samples, expected_samples=doc.expected_samples,
            buffer_samples=doc.buffer_samples, step_wait_times=list(doc.step_wait_times),
            step_wait_samples=list(doc.step_wait_samples), only_hybrid=doc.only_hybrid,
            last_activate_duration_s=doc.last_activate_duration_s,
            last_deactivate_duration_s=doc.last_deactivate_duration_s)
