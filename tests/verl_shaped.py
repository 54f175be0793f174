"""A verl-shaped package for the conformance tests, written here (not taken from verl).

:func:`write_verl_package` lays out ``verl/experimental/fully_async_policy/dynamic_schedule/``
as verl does - ``base.py`` (an ABC ``DynamicSchedulePolicyBase`` with verl's
method signatures, ``DynamicScheduleContext``, ``register_policy``,
``build_policy``), ``default_policy.py``, ``fixed_ratio_policy.py``,
``static_fully_async_policy.py`` - plus the reference document's section-6
example as ``my_policy.py``. The policy modules behave as verl's: they
``import ray`` at the top, and ``request_rebalance`` calls
``ray.get(self._rollouter.rebalance_requests.remote(reset_prefix_cache=...))``.
The decision rules are verl's formulas, restated independently of rollmesh's
own implementation so that the tests compare two codings of the same rules.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

PACKAGE = "verl.experimental.fully_async_policy.dynamic_schedule"

_BASE = '''
"""verl-shaped base: the abstract policy API, the context and the registry."""
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_registry = {}


def register_policy(name):
    def wrap(cls):
        _registry[name] = cls
        return cls
    return wrap


def build_policy(name, **kwargs):
    return _registry[name](**kwargs)


@dataclass
class DynamicScheduleContext:
    required_samples: int
    trigger_parameter_sync_step: int
    total_generated_samples: int
    expected_samples: int
    buffer_samples: int
    step_wait_times: list = field(default_factory=list)
    step_wait_samples: list = field(default_factory=list)
    only_hybrid: bool = False
    last_activate_duration_s: float = 0.0
    last_deactivate_duration_s: float = 0.0
    step_required_samples: int = field(init=False)

    def __post_init__(self):
        self.step_required_samples = self.required_samples * self.trigger_parameter_sync_step


class DynamicSchedulePolicyBase(ABC):
    @abstractmethod
    def should_deactivate(self, global_steps, is_hybrid_active, ctx): ...

    @abstractmethod
    def deactivate_wait_samples(self, ctx): ...

    def update_after_step(self, global_steps, ctx):
        pass

    @abstractmethod
    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx): ...

    def request_rebalance(self, global_steps, ctx, reset_prefix_cache=True):
        pass
'''

_DEFAULT = '''
"""verl-shaped default policy: adaptive ratio (unbounded below) and the cost/benefit gate."""
import ray

from .base import DynamicSchedulePolicyBase, register_policy


@register_policy("default")
class DefaultDynamicSchedulePolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio=0.3, only_hybrid=False):
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid
        self._overheads = []
        self._per_sample = 1000.0
        self.rebalance_results = []

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def _gap(self, ctx):
        return self.deactivate_ratio * ctx.step_required_samples - (ctx.total_generated_samples - ctx.expected_samples)

    def _switch_cost(self):
        recent = self._overheads[-3:]
        return sum(recent) / len(recent) if recent else 10.0

    def update_after_step(self, global_steps, ctx):
        if global_steps <= 0 or self.only_hybrid:
            return
        overhead = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if overhead > 0:
            self._overheads.append(overhead)
        waited = sum(ctx.step_wait_samples)
        if waited > 0:
            step = waited / ctx.step_required_samples if ctx.step_required_samples > 0 else 0.1
            self.deactivate_ratio = min(1.0, self.deactivate_ratio + min(0.1, max(0.02, step)))
        else:
            self.deactivate_ratio -= 0.02

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        if self.only_hybrid:
            return True
        gap = self._gap(ctx)
        if gap <= 0:
            return False
        wait, samples = sum(ctx.step_wait_times), sum(ctx.step_wait_samples)
        if wait > 0 and samples > 0:
            self._per_sample = wait / samples
        return max(0.0, gap) * self._per_sample - self._switch_cost() > 0

    def request_rebalance(self, global_steps, ctx, reset_prefix_cache=True):
        if getattr(self, "_rollouter", None) is None:
            return
        try:
            result = ray.get(self._rollouter.rebalance_requests.remote(reset_prefix_cache=reset_prefix_cache))
            self.rebalance_results.append(result)
        except Exception as err:
            self.rebalance_results.append(err)
'''

_FIXED = '''
"""verl-shaped fixed_ratio policy: a pure gap check, no adaptation."""
import ray

from .base import DynamicSchedulePolicyBase, register_policy


@register_policy("fixed_ratio")
class FixedRatioDynamicSchedulePolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio=0.3, only_hybrid=False):
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return int(ctx.step_required_samples * self.deactivate_ratio)

    def update_after_step(self, global_steps, ctx):
        pass

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        if self.only_hybrid:
            return True
        return ctx.total_generated_samples - ctx.expected_samples < self.deactivate_ratio * ctx.step_required_samples

    def request_rebalance(self, global_steps, ctx, reset_prefix_cache=True):
        try:
            ray.get(self._rollouter.rebalance_requests.remote(reset_prefix_cache=reset_prefix_cache))
        except Exception:
            pass
'''

_STATIC = '''
"""verl-shaped static_fully_async policy."""
from .base import DynamicSchedulePolicyBase, register_policy


@register_policy("static_fully_async")
class StaticFullyAsyncPolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio=0.3, only_hybrid=False):
        self.deactivate_ratio = 1.0 if only_hybrid else deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return 0

    def update_after_step(self, global_steps, ctx):
        return

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return False
'''

_MY_POLICY = '''
"""The reference document's section-6 example, against the verl-shaped package."""
from verl.experimental.fully_async_policy.dynamic_schedule import (
    DynamicScheduleContext,
    DynamicSchedulePolicyBase,
    register_policy,
)


@register_policy("my_policy")
class MyDynamicSchedulePolicy(DynamicSchedulePolicyBase):

    def __init__(self, deactivate_ratio: float = 0.5, only_hybrid: bool = False):
        self.deactivate_ratio = deactivate_ratio
        self.only_hybrid = only_hybrid

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        return int(ctx.required_samples * ctx.trigger_parameter_sync_step * self.deactivate_ratio)

    def should_activate_after_step(self, global_steps: int, is_hybrid_active: bool,
                                   ctx: DynamicScheduleContext) -> bool:
        return ctx.total_generated_samples < ctx.expected_samples + ctx.buffer_samples

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        pass

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        pass
'''

_INIT = '''
from .base import DynamicScheduleContext, DynamicSchedulePolicyBase, build_policy, register_policy
from .default_policy import DefaultDynamicSchedulePolicy
from .fixed_ratio_policy import FixedRatioDynamicSchedulePolicy
from .static_fully_async_policy import StaticFullyAsyncPolicy
'''

FILES = {
    "verl/__init__.py": '"""verl-shaped top package (tests only)."""\n',
    "verl/experimental/__init__.py": "",
    "verl/experimental/fully_async_policy/__init__.py": "",
    "verl/experimental/fully_async_policy/dynamic_schedule/__init__.py": _INIT,
    "verl/experimental/fully_async_policy/dynamic_schedule/base.py": _BASE,
    "verl/experimental/fully_async_policy/dynamic_schedule/default_policy.py": _DEFAULT,
    "verl/experimental/fully_async_policy/dynamic_schedule/fixed_ratio_policy.py": _FIXED,
    "verl/experimental/fully_async_policy/dynamic_schedule/static_fully_async_policy.py": _STATIC,
    "verl/experimental/fully_async_policy/dynamic_schedule/my_policy.py": _MY_POLICY,
}

DEFAULT = f"{PACKAGE}.default_policy:DefaultDynamicSchedulePolicy"
FIXED = f"{PACKAGE}.fixed_ratio_policy:FixedRatioDynamicSchedulePolicy"
STATIC = f"{PACKAGE}.static_fully_async_policy:StaticFullyAsyncPolicy"
MY_POLICY = f"{PACKAGE}.my_policy:MyDynamicSchedulePolicy"


def write_verl_package(root: Path) -> Path:
    """Write the package under ``root`` (put ``root`` on ``sys.path`` / PYTHONPATH); returns ``root``."""
    for relative, text in FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def forget_verl_modules() -> None:
    """Drop the package from ``sys.modules`` so another test's copy is imported afresh."""
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]


# verl's async_training block (fully_async_ppo_trainer.yaml plus the dynamic-scheduling keys of the
# reference document), with verl's defaults, as a verl user would paste it.
VERL_ASYNC_TRAINING = {
    "staleness_threshold": 0.1,
    "trigger_parameter_sync_step": 4,
    "require_batches": 1,
    "partial_rollout": True,
    "use_trainer_do_validate": False,
    "parallel_validate_and_rollout": False,
    "use_dynamic_resource_scheduling": False,
    "dynamic_schedule_policy": "default",
    "dynamic_schedule_deactivate_ratio": 0.3,
    "dynamic_schedule_enable_rebalance": True,
    "concurrent_samples_per_replica": 16,
}
# keys seen in other verl async_training blocks (async.yaml): accepted as well
VERL_ASYNC_TRAINING_EXTRA = {
    "use_rollout_log_probs": True,
    "compute_prox_log_prob": False,
    "checkpoint_engine": {"enable": False, "device_buffer_size_M": 4096, "overlap_broadcast_and_consume": False},
}
