"""The autoscaler's configuration: the reference's fields and defaults, checked on load.

Decisions are made by :class:`controller.scaling.autoscaler.Autoscaler`, which
re-exports everything here.
"""

from __future__ import annotations

import dataclasses
from typing import Any


SCALE_OUT = "scale_out"
SCALE_IN = "scale_in"
NONE = "none"

QUEUE_BACKLOG_DURATION_SECS = 20.0
QUEUE_LATENCY_DURATION_SECS = 15.0
TTFT_DURATION_SECS = 15.0
THROUGHPUT_STABLE_WINDOW_SECS = 60.0

SCALE_OUT_CONDITIONS = (
    "token_usage_high",
    "queue_backlog",
    "queue_latency_high",
    "ttft_high",
)
SCALE_IN_CONDITIONS = ("token_usage_low", "no_queue", "throughput_stable")


@dataclasses.dataclass
class ScaleOutPolicy:
    token_usage_threshold: float = 0.85
    queue_depth_per_engine: int = 10
    queue_time_p95_threshold: float = 5.0
    ttft_p95_threshold: float = 10.0
    condition_duration_secs: float = 30.0
    max_delta: int = 4


@dataclasses.dataclass
class ScaleInPolicy:
    token_usage_threshold: float = 0.3
    queue_depth_threshold: int = 0
    throughput_variance_threshold: float = 0.1
    condition_duration_secs: float = 120.0
    max_delta: int = 1
    projected_usage_max: float = 0.5


@dataclasses.dataclass
class ConditionDurations:
    """rollmesh extension (YAML section ``condition_durations``): the durations the reference fixes."""

    queue_backlog_secs: float = QUEUE_BACKLOG_DURATION_SECS
    queue_latency_high_secs: float = QUEUE_LATENCY_DURATION_SECS
    ttft_high_secs: float = TTFT_DURATION_SECS
    throughput_stable_secs: float = THROUGHPUT_STABLE_WINDOW_SECS


@dataclasses.dataclass
class AutoscalerConfig:
    enabled: bool = True
    min_engines: int = 1
    max_engines: int = 32
    scale_out_cooldown_secs: float = 60.0
    scale_in_cooldown_secs: float = 300.0
    metrics_interval_secs: float = 10.0
    evaluation_interval_secs: float = 30.0
    condition_window_secs: float = 60.0
    scale_out_policy: ScaleOutPolicy = dataclasses.field(default_factory=ScaleOutPolicy)
    scale_in_policy: ScaleInPolicy = dataclasses.field(default_factory=ScaleInPolicy)
    condition_durations: ConditionDurations = dataclasses.field(default_factory=ConditionDurations)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoscalerConfig:
        """Build from the reference YAML mapping; unknown keys (e.g. rollout_service_url) are ignored."""
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        out = {
            k: v
            for k, v in data.items()
            if k in names and k not in ("scale_out_policy", "scale_in_policy", "condition_durations")
        }
        so_names = {f.name for f in dataclasses.fields(ScaleOutPolicy)}
        si_names = {f.name for f in dataclasses.fields(ScaleInPolicy)}
        so = {
            k: v
            for k, v in (data.get("scale_out_policy") or {}).items()
            if k in so_names
        }
        si = {
            k: v
            for k, v in (data.get("scale_in_policy") or {}).items()
            if k in si_names
        }
        cd_names = {f.name for f in dataclasses.fields(ConditionDurations)}
        cd = {k: v for k, v in (data.get("condition_durations") or {}).items() if k in cd_names}
        cfg = cls(
            **out,
            scale_out_policy=ScaleOutPolicy(**so),
            scale_in_policy=ScaleInPolicy(**si),
            condition_durations=ConditionDurations(**cd),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def fail(field: str, msg: str) -> None:
            raise ValueError(f"{field}: {msg}")

        if self.min_engines < 0:
            fail("min_engines", f"must be >= 0, got {self.min_engines}")
        if self.max_engines < 1:
            fail("max_engines", f"must be >= 1, got {self.max_engines}")
        if self.min_engines > self.max_engines:
            fail(
                "min_engines",
                f"must be <= max_engines ({self.min_engines} > {self.max_engines})",
            )
        for name in (
            "scale_out_cooldown_secs",
            "scale_in_cooldown_secs",
        ):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0, got {getattr(self, name)}")
        for name in (
            "metrics_interval_secs",
            "evaluation_interval_secs",
            "condition_window_secs",
        ):
            if getattr(self, name) <= 0:
                fail(name, f"must be > 0, got {getattr(self, name)}")
        so, si = self.scale_out_policy, self.scale_in_policy
        if not 0.0 <= so.token_usage_threshold <= 1.0:
            fail(
                "scale_out_policy.token_usage_threshold",
                f"must be in [0, 1], got {so.token_usage_threshold}",
            )
        if so.queue_depth_per_engine < 0:
            fail(
                "scale_out_policy.queue_depth_per_engine",
                f"must be >= 0, got {so.queue_depth_per_engine}",
            )
        if so.queue_time_p95_threshold < 0:
            fail(
                "scale_out_policy.queue_time_p95_threshold",
                f"must be >= 0, got {so.queue_time_p95_threshold}",
            )
        if so.ttft_p95_threshold < 0:
            fail(
                "scale_out_policy.ttft_p95_threshold",
                f"must be >= 0, got {so.ttft_p95_threshold}",
            )
        if so.condition_duration_secs < 0:
            fail(
                "scale_out_policy.condition_duration_secs",
                f"must be >= 0, got {so.condition_duration_secs}",
            )
        if so.max_delta < 1:
            fail("scale_out_policy.max_delta", f"must be >= 1, got {so.max_delta}")
        if not 0.0 <= si.token_usage_threshold <= 1.0:
            fail(
                "scale_in_policy.token_usage_threshold",
                f"must be in [0, 1], got {si.token_usage_threshold}",
            )
        if si.token_usage_threshold >= so.token_usage_threshold:
            fail(
                "scale_in_policy.token_usage_threshold",
                f"must be < scale_out_policy.token_usage_threshold ({si.token_usage_threshold} >= "
                f"{so.token_usage_threshold})",
            )
        if si.queue_depth_threshold < 0:
            fail(
                "scale_in_policy.queue_depth_threshold",
                f"must be >= 0, got {si.queue_depth_threshold}",
            )
        if si.throughput_variance_threshold < 0:
            fail(
                "scale_in_policy.throughput_variance_threshold",
                f"must be >= 0, got {si.throughput_variance_threshold}",
            )
        if si.condition_duration_secs < 0:
            fail(
                "scale_in_policy.condition_duration_secs",
                f"must be >= 0, got {si.condition_duration_secs}",
            )
        for field in dataclasses.fields(ConditionDurations):
            value = getattr(self.condition_durations, field.name)
            if not value > 0:
                fail(f"condition_durations.{field.name}", f"must be > 0, got {value}")
        if si.max_delta < 1:
            fail("scale_in_policy.max_delta", f"must be >= 1, got {si.max_delta}")
        if not 0.0 < si.projected_usage_max <= 1.0:
            fail(
                "scale_in_policy.projected_usage_max",
                f"must be in (0, 1], got {si.projected_usage_max}",
            )
