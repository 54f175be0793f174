"""Scheduling policies: the base class, the registry and the three built-ins.

Importing this package registers ``default``, ``static_fully_async``,
``fixed_ratio`` (verl's three built-ins, deciding as verl's code does),
``balanced`` (rollmesh's) and ``reference_example`` (the reference document's
section-6 example). Like verl's ``dynamic_schedule`` package it also exports
``DynamicScheduleContext``, so a custom policy's imports change only in the
package name - and a policy written against verl's own package loads by
import path unchanged (:mod:`.handle`, :mod:`.verl_compat`).
"""

from ..context import DynamicScheduleContext
from .balanced import BalancedDynamicSchedulePolicy
from .base import DynamicSchedulePolicyBase, StepOutcome
from .default import DefaultDynamicSchedulePolicy
from .fixed_ratio import FixedRatioDynamicSchedulePolicy
from .handle import REQUIRED_METHODS, PolicyHandle, check_policy_class
from .reference_example import ReferenceExamplePolicy
from .registry import create_policy, register_policy, registered_policies, resolve_policy
from .static import StaticFullyAsyncPolicy

__all__ = [
    "BalancedDynamicSchedulePolicy",
    "DefaultDynamicSchedulePolicy",
    "DynamicScheduleContext",
    "DynamicSchedulePolicyBase",
    "FixedRatioDynamicSchedulePolicy",
    "PolicyHandle",
    "REQUIRED_METHODS",
    "ReferenceExamplePolicy",
    "StaticFullyAsyncPolicy",
    "StepOutcome",
    "check_policy_class",
    "create_policy",
    "register_policy",
    "registered_policies",
    "resolve_policy",
]
