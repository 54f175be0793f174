"""``default``: adaptive ``deactivate_ratio`` plus a cost/benefit activation gate.

Behaviour (reference section 3.1), with rollmesh's fixes of known weaknesses
1 and 2:

* ``should_deactivate`` returns ``is_hybrid_active``.
* ``deactivate_wait_samples`` is ``int(deactivate_ratio x required_samples x
  trigger_parameter_sync_step)``.
* ``update_after_step`` adapts the ratio from ``step_wait_samples``: with real
  waits ``ratio += clip(total_wait_samples / step_required_samples, 0.02,
  0.1)``, without ``ratio -= 0.02``; disabled when ``only_hybrid``.

  - The ratio is clamped to ``[min_ratio, max_ratio]``, by default
    ``[0.05, 1.0]``. The upper end is one full sync cycle of samples: waiting
    for more keeps trainer GPUs generating after the trainer already has
    everything the whole step consumes, which only delays training (the
    reference calls 1.0 "wait for a full batch"). The lower end stays
    positive: at 0 or below the replicas would be released the instant a
    step begins, paying a full activate + deactivate switch for no samples,
    and a negative ratio (the reference's bug) needs many cycles of +0.02 to
    become useful again. 0.05 keeps a small real wait, and from the floor
    the default 0.3 is at most 13 wait cycles away.
  - The ratio adapts **only on steps where it was used**: the controller
    reports each step's :class:`StepOutcome` through ``observe_step``, and
    ``update_after_step`` changes the ratio only when that outcome says a
    deactivation waited on it. Without a report for the step nothing changes,
    so an inactive hybrid pool no longer drifts the ratio down.
  - The adapted value is rounded to 1e-10 so float drift (0.3 - 0.02 + 0.02 =
    0.29999999999999993) cannot make the ``int()`` threshold a sample short.

* ``should_activate_after_step`` activates when a positive gap exists
  (``gap = expected_samples + buffer_samples - total_generated_samples > 0``)
  and ``gap x per_sample_time > switch_cost``. ``switch_cost`` is the mean of
  the last 3 measured activate + deactivate durations (10 s without history);
  ``per_sample_time`` is ``total_wait / total_wait_samples`` over the latest
  step's wait signals (1000 s before any real signal). When ``only_hybrid``
  there is no standalone generation at all, so the shortfall costs unbounded
  time and the gap check alone decides.

Freshness (weakness 2): the estimates are refreshed on every step in
``observe_step`` - which the controller calls before
``should_activate_after_step`` - whether or not a gap exists. The per-sample
time changes whenever the step carries a real signal (waited samples and
wait time both > 0); a step without one keeps the previous estimate. The
switch-cost history grows by one entry for every step with a deactivation.
``should_activate_after_step`` therefore decides on estimates that include
the step just finished, and on the ratio from before this step's
``update_after_step`` (the gate does not read the ratio; the adapted ratio
applies to the next step's ``deactivate_wait_samples``).
"""

from __future__ import annotations

from typing import Any

from ..context import DynamicScheduleContext
from ..errors import PolicyError
from .base import DynamicSchedulePolicyBase, StepOutcome
from .registry import register_policy

_ROUND_DIGITS = 10


@register_policy("default")
class DefaultDynamicSchedulePolicy(DynamicSchedulePolicyBase):
    """Adaptive dynamic scheduling; the recommended policy."""

    INCREASE_MIN = 0.02
    """Smallest increase of the ratio on a step with real waits."""
    INCREASE_MAX = 0.1
    """Largest increase of the ratio on a step with real waits."""
    DECREASE = 0.02
    """Decrease of the ratio on a step without real waits."""
    SWITCH_COST_WINDOW = 3
    """Measured activate + deactivate durations averaged into ``switch_cost``."""
    DEFAULT_SWITCH_COST_S = 10.0
    """``switch_cost`` before any switch was measured."""
    DEFAULT_PER_SAMPLE_TIME_S = 1000.0
    """Pessimistic per-sample time before any real signal (biases toward activation)."""

    def __init__(self, deactivate_ratio: float = 0.3, only_hybrid: bool = False, *,
                 min_ratio: float = 0.05, max_ratio: float = 1.0) -> None:
        if not 0.0 <= min_ratio <= max_ratio <= 1.0:
            raise PolicyError(f"need 0 <= min_ratio <= max_ratio <= 1, got min_ratio={min_ratio}, "
                              f"max_ratio={max_ratio}")
        if not min_ratio <= deactivate_ratio <= max_ratio:
            raise PolicyError(f"dynamic_schedule_deactivate_ratio={deactivate_ratio} is outside "
                              f"[{min_ratio}, {max_ratio}] for policy {type(self).__name__}; "
                              f"choose a value in range or widen min_ratio/max_ratio")
        self.deactivate_ratio = float(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)
        self.min_ratio = float(min_ratio)
        self.max_ratio = float(max_ratio)
        self.per_sample_time_s = self.DEFAULT_PER_SAMPLE_TIME_S
        self.has_rate_signal = False
        self.switch_cost_history: list[float] = []
        self.last_gap: int | None = None
        self.last_adaptation = "none"
        self._outcome: StepOutcome | None = None   # the latest step's, from observe_step
        self._refreshed_step: int | None = None

    # --- reference API ---

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool,
                          ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(self.deactivate_ratio * ctx.required_samples * ctx.trigger_parameter_sync_step)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        self._refresh_rate(global_steps, ctx)
        gap = self.gap(ctx)
        self.last_gap = gap
        if gap <= 0:
            return False
        if self.only_hybrid:
            return True
        return gap * self.per_sample_time_s > self.switch_cost_s

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        self._refresh_rate(global_steps, ctx)
        if self.only_hybrid:
            self.last_adaptation = "disabled (only_hybrid)"
            return
        outcome = self._outcome
        if outcome is None or outcome.global_step != global_steps or not outcome.ratio_used:
            self.last_adaptation = "skipped (ratio not used this step)"
            return
        total_wait_samples = sum(ctx.step_wait_samples)
        if total_wait_samples > 0:
            if ctx.step_required_samples > 0:
                step = min(max(total_wait_samples / ctx.step_required_samples, self.INCREASE_MIN),
                           self.INCREASE_MAX)
            else:
                step = self.INCREASE_MAX
            ratio = self.deactivate_ratio + step
            self.last_adaptation = f"+{step:g} (waited on {total_wait_samples} samples)"
        else:
            ratio = self.deactivate_ratio - self.DECREASE
            self.last_adaptation = f"-{self.DECREASE:g} (no waits)"
        self.deactivate_ratio = round(min(max(ratio, self.min_ratio), self.max_ratio), _ROUND_DIGITS)

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        return True

    # --- rollmesh extensions ---

    def observe_step(self, global_steps: int, outcome: StepOutcome,
                     ctx: DynamicScheduleContext) -> None:
        repeated = self._outcome is not None and self._outcome.global_step == global_steps
        self._outcome = outcome
        self._refresh_rate(global_steps, ctx)
        if outcome.deactivated and not repeated:
            cost = outcome.activate_duration_s + outcome.deactivate_duration_s
            self.switch_cost_history = (self.switch_cost_history + [float(cost)])[-self.SWITCH_COST_WINDOW:]

    @staticmethod
    def gap(ctx: DynamicScheduleContext) -> int:
        """Samples by which generation lags expectation plus headroom."""
        return ctx.expected_samples + ctx.buffer_samples - ctx.total_generated_samples

    @property
    def switch_cost_s(self) -> float:
        """Mean of the last measured activate + deactivate durations (10 s without any)."""
        if not self.switch_cost_history:
            return self.DEFAULT_SWITCH_COST_S
        return sum(self.switch_cost_history) / len(self.switch_cost_history)

    def _refresh_rate(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        if self._refreshed_step == global_steps:
            return
        self._refreshed_step = global_steps
        total_wait = sum(ctx.step_wait_times)
        total_samples = sum(ctx.step_wait_samples)
        if total_samples > 0 and total_wait > 0:
            self.per_sample_time_s = total_wait / total_samples
            self.has_rate_signal = True

    def state_dict(self) -> dict[str, Any]:
        return {"deactivate_ratio": self.deactivate_ratio,
                "per_sample_time_s": self.per_sample_time_s,
                "has_rate_signal": self.has_rate_signal,
                "switch_cost_history": list(self.switch_cost_history),
                "refreshed_step": self._refreshed_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.deactivate_ratio = float(state.get("deactivate_ratio", self.deactivate_ratio))
        self.per_sample_time_s = float(state.get("per_sample_time_s", self.per_sample_time_s))
        self.has_rate_signal = bool(state.get("has_rate_signal", self.has_rate_signal))
        self.switch_cost_history = [float(v) for v in state.get("switch_cost_history", [])]
        self.switch_cost_history = self.switch_cost_history[-self.SWITCH_COST_WINDOW:]
        self._refreshed_step = state.get("refreshed_step")

    def parameters(self) -> dict[str, Any]:
        return {"deactivate_ratio": self.deactivate_ratio, "only_hybrid": self.only_hybrid,
                "min_ratio": self.min_ratio, "max_ratio": self.max_ratio}
