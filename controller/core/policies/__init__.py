"""Scheduling policies: the base class, the registry and the three built-ins.

Importing this package registers ``default``, ``static_fully_async`` and
``fixed_ratio``. Like the reference's ``dynamic_schedule`` package it also
exports ``DynamicScheduleContext``, so a custom policy's imports change only
in the package name.
"""

from ..context import DynamicScheduleContext
from .balanced import BalancedDynamicSchedulePolicy
from .base import DynamicSchedulePolicyBase, StepOutcome
from .default import DefaultDynamicSchedulePolicy
from .fixed_ratio import FixedRatioDynamicSchedulePolicy
from .registry import create_policy, register_policy, registered_policies, resolve_policy
from .static import StaticFullyAsyncPolicy

__all__ = [
    "BalancedDynamicSchedulePolicy",
    "DefaultDynamicSchedulePolicy",
    "DynamicScheduleContext",
    "DynamicSchedulePolicyBase",
    "FixedRatioDynamicSchedulePolicy",
    "StaticFullyAsyncPolicy",
    "StepOutcome",
    "create_policy",
    "register_policy",
    "registered_policies",
    "resolve_policy",
]
