"""Pure decision core of the autoscaler (reference: "Autoscaler: Automatic Scaling").

No I/O, no wall clock, no RPC: the caller feeds :class:`MetricsSample` objects
with :meth:`Autoscaler.record_metrics`, asks :meth:`Autoscaler.evaluate` with
the current time, and reports executed operations with
:meth:`Autoscaler.record_scale`.

Rules this module fixes where the reference leaves room:

* **Condition durations** are measured on sample timestamps. Each condition
  keeps the time of the first sample of its current unbroken run of samples
  for which it holds; ``held_for = latest_sample.time - run_start``. A single
  sample where it does not hold resets the run (a flickering condition never
  triggers). Durations: token_usage_high ``scale_out_policy.condition_duration_secs``
  (30 s), queue_backlog 20 s, queue_latency_high 15 s, ttft_high 15 s,
  token_usage_low and no_queue ``scale_in_policy.condition_duration_secs``
  (120 s), throughput_stable 60 s. The fixed durations of the reference can be
  changed in the ``condition_durations`` section (a rollmesh extension;
  the defaults are the reference's).
* **throughput_stable** compares the squared coefficient of variation of
  throughput, ``population variance / mean**2``, over the samples of the last
  60 s against ``throughput_variance_threshold``. It is only met when those
  samples span at least 60 s. With mean 0 it is met iff every sample is 0.
* **no_queue** holds when ``total_queue_reqs <= queue_depth_threshold``.
* **queue_backlog** holds when ``total_queue_reqs > queue_depth_per_engine x num_engines``.
* **Fresh metrics**: no decision without a sample, when the latest sample is
  older than ``condition_window_secs``, when it reports 0 engines, or, when
  the caller passes ``current_engines``, when fewer engines reported than
  are running (``latest.num_engines < current_engines``).
* **After a scale operation** (``record_scale``) every condition run is
  restarted and the sample history cleared: the old samples describe the
  previous engine count.
* Scale-out takes precedence over scale-in. The engine count used for
  deltas is ``current_engines`` when given, else the latest sample's
  ``num_engines``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

from .autoscaler_config import (  # noqa: F401 - the config, re-exported
    AutoscalerConfig,
    ConditionDurations,
    NONE,
    QUEUE_BACKLOG_DURATION_SECS,
    QUEUE_LATENCY_DURATION_SECS,
    SCALE_IN,
    SCALE_IN_CONDITIONS,
    SCALE_OUT,
    SCALE_OUT_CONDITIONS,
    ScaleInPolicy,
    ScaleOutPolicy,
    THROUGHPUT_STABLE_WINDOW_SECS,
    TTFT_DURATION_SECS,
)

@dataclasses.dataclass(frozen=True)
class MetricsSample:
    """Aggregated metrics of one collection round. ``num_engines`` is the number of engines that reported."""

    time: float
    num_engines: int
    avg_token_usage: float
    total_queue_reqs: int
    queue_time_p95: float
    ttft_p95: float
    throughput: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ConditionStatus:
    name: str
    type: str  # "scale_out" | "scale_in"
    triggered: bool
    held_for: float
    required_for: float
    value: float | None
    threshold: float


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # "scale_out" | "scale_in" | "none"
    delta: int
    reason: str
    triggered_conditions: tuple[str, ...] = ()
    metrics_snapshot: dict[str, Any] = dataclasses.field(default_factory=dict)


def scale_out_delta(
    token_usage: float, queue_depth: int, engines: int, max_delta: int
) -> int:
    """The reference formula, verbatim (before the max_engines cap)."""
    if token_usage > 0.9:
        usage_delta = int((token_usage - 0.7) / 0.1)
    else:
        usage_delta = 0
    queue_delta = max(0, (queue_depth - engines * 5) // 20)
    return min(max(usage_delta, queue_delta, 1), max_delta)


def throughput_cv2(values: list[float]) -> float:
    """Population variance of ``values`` divided by their mean squared (inf if mean is 0 and values differ)."""
    if not values:
        return math.inf
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    if mean == 0:
        return 0.0 if var == 0 else math.inf
    return var / (mean * mean)


class Autoscaler:
    def __init__(self, config: AutoscalerConfig | None = None) -> None:
        self.config = config or AutoscalerConfig()
        self.config.validate()
        self.enabled = self.config.enabled
        self._samples: deque[MetricsSample] = deque()
        self._run_start: dict[str, float | None] = {}
        self.last_scale_action: str | None = None
        self.last_scale_time: float | None = None
        self.last_decision: Decision | None = None
        self._reset_runs()

    # ---- inputs -------------------------------------------------------
    def _reset_runs(self) -> None:
        self._run_start = {
            name: None
            for name in SCALE_OUT_CONDITIONS + ("token_usage_low", "no_queue")
        }

    def _retention(self) -> float:
        return max(self.config.condition_window_secs, self.config.condition_durations.throughput_stable_secs)

    def _instant(self, s: MetricsSample) -> dict[str, tuple[bool, float, float]]:
        """name -> (holds, value, threshold) for the streak-tracked conditions."""
        so, si = self.config.scale_out_policy, self.config.scale_in_policy
        backlog_thr = float(so.queue_depth_per_engine * s.num_engines)
        return {
            "token_usage_high": (
                s.avg_token_usage > so.token_usage_threshold,
                s.avg_token_usage,
                so.token_usage_threshold,
            ),
            "queue_backlog": (
                s.total_queue_reqs > backlog_thr,
                float(s.total_queue_reqs),
                backlog_thr,
            ),
            "queue_latency_high": (
                s.queue_time_p95 > so.queue_time_p95_threshold,
                s.queue_time_p95,
                so.queue_time_p95_threshold,
            ),
            "ttft_high": (
                s.ttft_p95 > so.ttft_p95_threshold,
                s.ttft_p95,
                so.ttft_p95_threshold,
            ),
            "token_usage_low": (
                s.avg_token_usage < si.token_usage_threshold,
                s.avg_token_usage,
                si.token_usage_threshold,
            ),
            "no_queue": (
                s.total_queue_reqs <= si.queue_depth_threshold,
                float(s.total_queue_reqs),
                float(si.queue_depth_threshold),
            ),
        }

    def _required(self, name: str) -> float:
        so, si = self.config.scale_out_policy, self.config.scale_in_policy
        return {
            "token_usage_high": so.condition_duration_secs,
            "queue_backlog": self.config.condition_durations.queue_backlog_secs,
            "queue_latency_high": self.config.condition_durations.queue_latency_high_secs,
            "ttft_high": self.config.condition_durations.ttft_high_secs,
            "token_usage_low": si.condition_duration_secs,
            "no_queue": si.condition_duration_secs,
            "throughput_stable": self.config.condition_durations.throughput_stable_secs,
        }[name]

    def record_metrics(self, sample: MetricsSample) -> None:
        """Append a sample; times must not go backwards."""
        if self._samples and sample.time < self._samples[-1].time:
            raise ValueError(
                f"time: sample at {sample.time} is older than the latest ({self._samples[-1].time})"
            )
        if sample.num_engines < 0:
            raise ValueError(f"num_engines: must be >= 0, got {sample.num_engines}")
        self._samples.append(sample)
        for name, (holds, _, _) in self._instant(sample).items():
            if not holds:
                self._run_start[name] = None
            elif self._run_start[name] is None:
                self._run_start[name] = sample.time
        cutoff = sample.time - self._retention()
        # Keep the newest sample at or before the cutoff: it anchors a window that spans the full
        # duration even when samples do not fall exactly on the window's edge.
        while len(self._samples) > 1 and self._samples[1].time <= cutoff:
            self._samples.popleft()

    def record_scale(self, action: str, now: float) -> None:
        """Note an executed scale operation: starts its cooldown and restarts all condition runs."""
        if action not in (SCALE_OUT, SCALE_IN):
            raise ValueError(
                f"action: must be {SCALE_OUT!r} or {SCALE_IN!r}, got {action!r}"
            )
        self.last_scale_action = action
        self.last_scale_time = now
        self._samples.clear()
        self._reset_runs()

    # ---- views --------------------------------------------------------
    @property
    def latest(self) -> MetricsSample | None:
        return self._samples[-1] if self._samples else None

    def samples(self) -> list[MetricsSample]:
        return list(self._samples)

    def _fresh(self, now: float) -> bool:
        s = self.latest
        return s is not None and now - s.time <= self.config.condition_window_secs

    def conditions(self, now: float) -> dict[str, ConditionStatus]:
        """Every scale-out and scale-in condition; none is triggered without fresh metrics."""
        s = self.latest
        fresh = self._fresh(now)
        out: dict[str, ConditionStatus] = {}
        inst = self._instant(s) if s is not None else {}
        for name in SCALE_OUT_CONDITIONS + ("token_usage_low", "no_queue"):
            ctype = SCALE_OUT if name in SCALE_OUT_CONDITIONS else SCALE_IN
            start = self._run_start[name]
            held = (s.time - start) if (s is not None and start is not None) else 0.0
            req = self._required(name)
            if s is not None:
                _, value, thr = inst[name]
            else:
                value, thr = None, self._static_threshold(name)
            out[name] = ConditionStatus(
                name,
                ctype,
                fresh and start is not None and held >= req,
                held,
                req,
                value,
                thr,
            )
        out["throughput_stable"] = self._throughput_status(fresh)
        return out

    def _static_threshold(self, name: str) -> float:
        so, si = self.config.scale_out_policy, self.config.scale_in_policy
        return {
            "token_usage_high": so.token_usage_threshold,
            "queue_backlog": float(so.queue_depth_per_engine),
            "queue_latency_high": so.queue_time_p95_threshold,
            "ttft_high": so.ttft_p95_threshold,
            "token_usage_low": si.token_usage_threshold,
            "no_queue": float(si.queue_depth_threshold),
        }[name]

    def _throughput_status(self, fresh: bool) -> ConditionStatus:
        thr = self.config.scale_in_policy.throughput_variance_threshold
        req = self.config.condition_durations.throughput_stable_secs
        s = self.latest
        if s is None:
            return ConditionStatus(
                "throughput_stable", SCALE_IN, False, 0.0, req, None, thr
            )
        older = [x for x in self._samples if x.time <= s.time - req]
        window = older[-1:] + [x for x in self._samples if x.time > s.time - req]
        span = s.time - window[0].time
        cv2 = throughput_cv2([x.throughput for x in window])
        stable = len(window) >= 2 and cv2 < thr
        held = span if stable else 0.0
        value = cv2 if math.isfinite(cv2) else float("inf")
        return ConditionStatus(
            "throughput_stable",
            SCALE_IN,
            fresh and stable and span >= req,
            held,
            req,
            value,
            thr,
        )

    # ---- decision -----------------------------------------------------
    def _in_cooldown(self, now: float) -> str | None:
        if self.last_scale_time is None:
            return None
        cd = (
            self.config.scale_out_cooldown_secs
            if self.last_scale_action == SCALE_OUT
            else self.config.scale_in_cooldown_secs
        )
        elapsed = now - self.last_scale_time
        if elapsed < cd:
            return f"In cooldown after {self.last_scale_action}: {elapsed:.1f}s of {cd:.1f}s elapsed"
        return None

    def evaluate(
        self, now: float, pending_operation: bool, current_engines: int | None = None
    ) -> Decision:
        """Decide one scaling action at time ``now``; the result is also kept as ``last_decision``."""
        d = self._evaluate(now, pending_operation, current_engines)
        self.last_decision = d
        return d

    def _evaluate(
        self, now: float, pending_operation: bool, current_engines: int | None
    ) -> Decision:
        cfg = self.config
        s = self.latest
        snap = s.as_dict() if s is not None else {}

        def none(reason: str, triggered: tuple[str, ...] = ()) -> Decision:
            return Decision(NONE, 0, reason, triggered, snap)

        if not self.enabled:
            return none("Autoscaler disabled")
        if pending_operation:
            return none("Scale operation pending")
        cd = self._in_cooldown(now)
        if cd:
            return none(cd)
        if s is None or not self._fresh(now):
            return none("No recent metrics")
        if s.num_engines <= 0:
            return none("No engines reporting metrics")
        if current_engines is not None and s.num_engines < current_engines:
            return none(
                f"Insufficient metrics: {s.num_engines}/{current_engines} engines reporting"
            )
        engines = current_engines if current_engines is not None else s.num_engines

        conds = self.conditions(now)
        out_hit = tuple(n for n in SCALE_OUT_CONDITIONS if conds[n].triggered)
        if out_hit:
            headroom = cfg.max_engines - engines
            if headroom <= 0:
                return none(
                    f"At max_engines ({cfg.max_engines}); conditions met: {', '.join(out_hit)}",
                    out_hit,
                )
            delta = scale_out_delta(
                s.avg_token_usage,
                s.total_queue_reqs,
                engines,
                cfg.scale_out_policy.max_delta,
            )
            delta = min(delta, headroom)
            return Decision(
                SCALE_OUT, delta, f"Conditions met: {', '.join(out_hit)}", out_hit, snap
            )

        in_hit = tuple(n for n in SCALE_IN_CONDITIONS if conds[n].triggered)
        if len(in_hit) == len(SCALE_IN_CONDITIONS):
            delta = min(cfg.scale_in_policy.max_delta, engines - cfg.min_engines)
            if delta <= 0:
                return none(
                    f"At min_engines ({cfg.min_engines}); conditions met: {', '.join(in_hit)}",
                    in_hit,
                )
            limit = cfg.scale_in_policy.projected_usage_max
            while delta > 0 and (
                engines - delta <= 0
                or s.avg_token_usage * engines / (engines - delta) >= limit
            ):
                delta -= 1
            if delta <= 0:
                projected = (
                    s.avg_token_usage * engines / (engines - 1)
                    if engines > 1
                    else math.inf
                )
                return none(
                    f"Projected usage {projected:.3f} would not stay below {limit}",
                    in_hit,
                )
            return Decision(
                SCALE_IN, delta, f"Conditions met: {', '.join(in_hit)}", in_hit, snap
            )
        return none("No scaling conditions met")
