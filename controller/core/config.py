"""``SchedulingConfig``: the dynamic-resource parameters, named as in the reference.

Section 2 of ``dynamic-resource-scheduling.md`` fixes the names and defaults
of the first seven fields. The remaining fields are rollmesh's; their
defaults are explained in their docstrings. As a config section it accepts
verl's whole ``async_training`` block (``accepts_verl_async_training``, see
:mod:`mesh_runtime.verl_config`). :meth:`SchedulingConfig.validate` raises
:class:`~controller.core.errors.InvalidArgumentError` naming the field and
what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from mesh_runtime import samples
from mesh_runtime.reasons import Reason
from mesh_runtime.verl_config import DEACTIVATE_WAIT_TIMEOUT_S, WEIGHT_SYNC_TIMEOUT_S

from .errors import InvalidArgumentError


@dataclasses.dataclass
class SchedulingConfig:
    """Settings of the dynamic resource controller."""

    accepts_verl_async_training: ClassVar[bool] = True

    use_dynamic_resource_scheduling: bool = False
    """Master switch; when False the policy is never consulted and hybrid replicas stay asleep."""
    dynamic_schedule_policy: str = "default"
    """Registered policy name, or an import path ``package.module:Class``."""
    dynamic_schedule_deactivate_ratio: float = 0.3
    """Initial ratio: wait for ``ratio x required_samples x trigger_parameter_sync_step`` samples."""
    dynamic_schedule_enable_rebalance: bool = True
    """Rebalance in-flight requests onto freshly activated hybrid replicas."""
    staleness_threshold: float = 0.1
    """Allowed sample staleness ratio (``buffer_samples = step_required_samples x staleness_threshold``)."""
    trigger_parameter_sync_step: int = 4
    """Collections per weight-sync step."""
    require_batches: int = 1
    """ppo_mini_batches per collection."""
    ppo_mini_batch_size: int = 256
    """Prompts per ppo_mini_batch (verl's ``actor_rollout_ref.actor.ppo_mini_batch_size`` and default);
    ``required_samples`` is this x ``require_batches`` unless a step report carries its own value."""
    dynamic_schedule_policy_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword parameters for the policy (e.g. ``min_ratio`` / ``max_ratio`` of ``default``)."""
    only_hybrid: bool = False
    """True when there are no standalone replicas (the reference's ``rollout.nnodes = 0``)."""
    deactivate_wait_timeout_s: float = DEACTIVATE_WAIT_TIMEOUT_S
    """Longest the trainer may wait for ``deactivate_wait_samples`` before releasing anyway.
    Ten minutes covers the rollout phase of one sync cycle of large models (the
    reference's runs take minutes per step) while bounding how long a stalled
    rollouter can keep trainer GPUs away from training."""
    port_timeout_s: float = 30.0
    """Deadline of each call to the load balancer or a replica agent (remove, abort,
    sleep, wake, resume, stop). Sleep offloads weights to host memory, which takes
    seconds for large models; 30 s bounds a hung agent without cutting that short."""
    weight_sync_timeout_s: float = WEIGHT_SYNC_TIMEOUT_S
    """Deadline of one weight broadcast (tens of GB over the network can take minutes)."""
    sleep_level: int = 1
    """Sleep level for released hybrid replicas: 1 offloads weights to host memory,
    2 discards them (every activation then needs a weight sync)."""

    @property
    def required_samples(self) -> int:
        """``ppo_mini_batch_size x require_batches``."""
        return samples.required_samples(self.ppo_mini_batch_size, self.require_batches)

    def validate(self) -> SchedulingConfig:
        """Check every field; returns self so it can be chained."""
        checks = [
            ("dynamic_schedule_deactivate_ratio", 0.0 <= self.dynamic_schedule_deactivate_ratio <= 1.0,
             "must be in [0, 1]"),
            ("staleness_threshold", self.staleness_threshold >= 0, "must be >= 0"),
            ("trigger_parameter_sync_step", self.trigger_parameter_sync_step >= 1, "must be >= 1"),
            ("require_batches", self.require_batches >= 1, "must be >= 1"),
            ("ppo_mini_batch_size", self.ppo_mini_batch_size >= 1, "must be >= 1"),
            ("deactivate_wait_timeout_s", self.deactivate_wait_timeout_s > 0, "must be > 0 seconds"),
            ("port_timeout_s", self.port_timeout_s > 0, "must be > 0 seconds"),
            ("weight_sync_timeout_s", self.weight_sync_timeout_s > 0, "must be > 0 seconds"),
            ("sleep_level", self.sleep_level in (1, 2), "must be 1 or 2"),
            ("dynamic_schedule_policy", bool(str(self.dynamic_schedule_policy).strip()),
             "must name a policy or an import path 'package.module:Class'"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidArgumentError(f"{name} {rule}, got {getattr(self, name)!r}",
                                           reason=Reason.INVALID_CONFIG, metadata={"field": name})
        return self
