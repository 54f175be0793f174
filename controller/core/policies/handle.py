"""How the controller calls a policy: any class with the reference's methods, by duck typing.

A policy is accepted when its class has the three methods verl's
``DynamicSchedulePolicyBase`` declares abstract - ``should_deactivate``,
``deactivate_wait_samples``, ``should_activate_after_step`` - whatever base
class it derives from: rollmesh's, verl's own ABC (loaded from a verl
checkout), or none. Everything else is optional and detected on the instance:

* ``update_after_step(global_steps, ctx)`` and
  ``request_rebalance(global_steps, ctx)``: the reference's points 4 and 5;
  missing means "do nothing" (verl's base defaults);
* rollmesh's hooks ``observe_step(global_steps, outcome, ctx)``,
  ``state_dict()`` / ``load_state_dict(state)`` and ``parameters()``; missing
  means: no step outcome, the ``deactivate_ratio`` attribute persisted when
  there is one, public scalar attributes reported.

Rebalance (``dynamic_schedule_enable_rebalance``): the controller rebalances
after an activation when ``request_rebalance`` returns a truthy value (the
rollmesh way) **or** calls ``self._rollouter.rebalance_requests.remote(...)``
during the call (the verl way; see :mod:`.verl_compat`). A policy that
inherits verl's no-op ``request_rebalance`` does neither and is not
rebalanced. The handle injects ``policy._rollouter`` exactly as verl's
``DynamicResourceController.__init__`` does.
"""

from __future__ import annotations

from typing import Any

from ..context import DynamicScheduleContext
from ..errors import PolicyError
from .verl_compat import RolloutHandle

REQUIRED_METHODS = ("should_deactivate", "deactivate_wait_samples", "should_activate_after_step")
"""The methods every policy must have (the abstract ones of verl's base class)."""


def check_policy_class(cls: Any, what: str) -> None:
    """Raise :class:`PolicyError` unless ``cls`` is a class with :data:`REQUIRED_METHODS`."""
    if not isinstance(cls, type):
        raise PolicyError(f"{what} is {cls!r}, not a class")
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
    if missing:
        raise PolicyError(f"{what} ({cls.__module__}.{cls.__qualname__}) is not a scheduling policy: it lacks "
                          f"{', '.join(missing)} (a policy needs {', '.join(REQUIRED_METHODS)})")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        raise PolicyError(f"{what} ({cls.__module__}.{cls.__qualname__}) leaves abstract methods "
                          f"{', '.join(abstract)} unimplemented")


class PolicyHandle:
    """Calls one policy instance; see the module docstring for what is optional."""

    def __init__(self, policy: Any) -> None:
        check_policy_class(type(policy), "the scheduling policy")
        self.policy = policy
        self.rollouter = RolloutHandle()
        try:
            policy._rollouter = self.rollouter
        except AttributeError:  # __slots__ without _rollouter: verl-style rebalance is then unavailable
            pass

    def _optional(self, name: str) -> Any:
        method = getattr(self.policy, name, None)
        return method if callable(method) else None

    # --- the reference's call order ---

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return bool(self.policy.should_deactivate(global_steps, is_hybrid_active, ctx))

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return max(0, int(self.policy.deactivate_wait_samples(ctx)))

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return bool(self.policy.should_activate_after_step(global_steps, is_hybrid_active, ctx))

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> tuple[bool, str]:
        """``(rebalance?, how it was asked: "returned", "rollouter" or "")``."""
        method = self._optional("request_rebalance")
        if method is None:
            return False, ""
        self.rollouter.clear()
        answer = method(global_steps, ctx)
        if self.rollouter.rebalance_requested:
            return True, "rollouter"
        if answer:
            return True, "returned"
        return False, ""

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        method = self._optional("update_after_step")
        if method is not None:
            method(global_steps, ctx)

    # --- rollmesh's optional hooks ---

    def observe_step(self, global_steps: int, outcome: Any, ctx: DynamicScheduleContext) -> None:
        method = self._optional("observe_step")
        if method is not None:
            method(global_steps, outcome, ctx)

    def state_dict(self) -> dict[str, Any]:
        method = self._optional("state_dict")
        if method is not None:
            return dict(method())
        ratio = getattr(self.policy, "deactivate_ratio", None)
        return {} if not isinstance(ratio, (int, float)) else {"deactivate_ratio": float(ratio)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        method = self._optional("load_state_dict")
        if method is not None:
            method(state)
        elif "deactivate_ratio" in state and hasattr(self.policy, "deactivate_ratio"):
            self.policy.deactivate_ratio = float(state["deactivate_ratio"])

    def parameters(self) -> dict[str, Any]:
        method = self._optional("parameters")
        if method is not None:
            return dict(method())
        return {key: value for key, value in vars(self.policy).items()
                if not key.startswith("_") and isinstance(value, (bool, int, float, str))}

    def attribute(self, name: str) -> Any:
        """A scalar attribute of the policy (``deactivate_ratio``, ``switch_cost_s``...), None if absent."""
        value = getattr(self.policy, name, None)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
