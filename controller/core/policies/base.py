"""rollmesh's policy base class and the per-step outcome the controller reports.

``DynamicSchedulePolicyBase`` has the reference's five methods with the
reference's (and verl's) signatures. Deriving from it is optional: the
controller accepts any class with the three required methods, verl's own
classes included (see :mod:`.handle`). rollmesh adds three optional hooks
with harmless defaults, which subclasses simply inherit and other classes
may leave out:

* ``observe_step(global_steps, outcome, ctx)`` - the controller tells the
  policy what really happened this step (was there a deactivation, did it wait
  on ``deactivate_wait_samples``, did the wait expire, how long did the switch
  take). It is called once per step, after the weight sync and *before*
  ``should_activate_after_step``; see ``controller/core/hybrid.py`` for the
  full order.
* ``state_dict()`` / ``load_state_dict(state)`` - persistence across
  controller restarts.
* ``parameters()`` - the policy's parameters, for GetSchedulerState.

``request_rebalance`` returns ``True`` to ask the controller for a rebalance;
the base default returns ``None``, meaning no rebalance, as verl's base does
nothing. (A verl-style policy asks through ``self._rollouter`` instead; both
work, see :mod:`.handle`.)
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from ..context import DynamicScheduleContext


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What the controller did to the hybrid replicas during one training step."""

    global_step: int
    """The step this outcome belongs to."""
    deactivated: bool = False
    """True when hybrid replicas were released this step after the trainer
    waited on ``deactivate_wait_samples`` - i.e. the ratio was *used*."""
    wait_samples: int = 0
    """The threshold the trainer waited for (0 without a deactivation)."""
    buffered_samples: int = 0
    """Samples buffered when the wait ended."""
    waited_s: float = 0.0
    """How long the trainer waited before releasing."""
    wait_expired: bool = False
    """True when the wait ran into ``deactivate_wait_timeout_s``."""
    deactivate_duration_s: float = 0.0
    """Measured duration of this step's deactivation (0 without one)."""
    activate_duration_s: float = 0.0
    """Measured duration of the activation this deactivation closed (0 if none was measured)."""

    @property
    def ratio_used(self) -> bool:
        """True when the deactivate ratio decided a real wait this step."""
        return self.deactivated

    def to_document(self) -> state_pb2.StepOutcome:
        return state_pb2.StepOutcome(
            global_step=self.global_step, deactivated=self.deactivated, wait_samples=self.wait_samples,
            buffered_samples=self.buffered_samples, waited_s=self.waited_s, wait_expired=self.wait_expired,
            deactivate_duration_s=self.deactivate_duration_s, activate_duration_s=self.activate_duration_s)

    @classmethod
    def from_document(cls, doc: state_pb2.StepOutcome) -> StepOutcome:
        return cls(global_step=doc.global_step, deactivated=doc.deactivated, wait_samples=doc.wait_samples,
                   buffered_samples=doc.buffered_samples, waited_s=doc.waited_s, wait_expired=doc.wait_expired,
                   deactivate_duration_s=doc.deactivate_duration_s, activate_duration_s=doc.activate_duration_s)


class DynamicSchedulePolicyBase(abc.ABC):
    """Decides when hybrid replicas are activated and deactivated.

    Per training step the controller calls, in order: ``should_deactivate``,
    ``deactivate_wait_samples`` (only if deactivating), ``observe_step``,
    ``should_activate_after_step``, ``request_rebalance`` (only after an
    activation, and only when rebalancing is enabled), ``update_after_step``.
    """

    @abc.abstractmethod
    def should_deactivate(self, global_steps: int, is_hybrid_active: bool,
                          ctx: DynamicScheduleContext) -> bool:
        """Return True to deactivate hybrid replicas before this step trains."""

    @abc.abstractmethod
    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """Return the minimum buffered-sample count before deactivation proceeds."""

    @abc.abstractmethod
    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        """Return True to (re-)activate hybrid replicas after the weight sync."""

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        """Update internal state after the step; the default does nothing."""
        return

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext,
                          reset_prefix_cache: bool = True) -> bool | None:
        """Return True to have requests redistributed after an activation; default: no."""
        return None

    # --- rollmesh extensions; reference-API subclasses inherit these defaults ---

    def observe_step(self, global_steps: int, outcome: StepOutcome,
                     ctx: DynamicScheduleContext) -> None:
        """Learn what the controller did this step; the default ignores it."""
        return

    def state_dict(self) -> dict[str, Any]:
        """State to persist; by default the ``deactivate_ratio`` attribute when there is one."""
        ratio = getattr(self, "deactivate_ratio", None)
        return {} if ratio is None else {"deactivate_ratio": float(ratio)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if "deactivate_ratio" in state and hasattr(self, "deactivate_ratio"):
            self.deactivate_ratio = float(state["deactivate_ratio"])

    def parameters(self) -> dict[str, Any]:
        """The policy's parameters by name (public scalar attributes by default)."""
        return {key: value for key, value in vars(self).items()
                if not key.startswith("_") and isinstance(value, (bool, int, float, str))}
