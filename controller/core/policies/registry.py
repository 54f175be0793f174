"""Policy registry: ``register_policy``, name / import-path resolution, ``create_policy``.

``dynamic_schedule_policy`` is either a registered name (``"default"``,
``"static_fully_async"``, ``"fixed_ratio"`` or one added with
``@register_policy``) or an import path ``package.module:ClassName``; the
latter needs no registration step at all. Anything unusable raises
:class:`~controller.core.errors.PolicyError` naming the offending value.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import PolicyError
from .base import DynamicSchedulePolicyBase

_REGISTRY: dict[str, type[DynamicSchedulePolicyBase]] = {}

P = TypeVar("P", bound=type[DynamicSchedulePolicyBase])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make ``cls`` available as ``dynamic_schedule_policy: name``.

    Registering a second, different class under a taken name is an error;
    registering the same class again (a module re-import) is allowed.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise PolicyError(f"policy name must be a non-empty string without ':', got {name!r}")

    def decorate(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, DynamicSchedulePolicyBase)):
            raise PolicyError(f"@register_policy({name!r}) needs a DynamicSchedulePolicyBase "
                              f"subclass, got {cls!r}")
        taken = _REGISTRY.get(name)
        if taken is not None and _qualified(taken) != _qualified(cls):
            raise PolicyError(f"policy name {name!r} is already registered for {_qualified(taken)}; "
                              f"pick another name for {_qualified(cls)}")
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_policies() -> dict[str, type[DynamicSchedulePolicyBase]]:
    """A copy of the name -> class registry."""
    return dict(_REGISTRY)


def resolve_policy(value: str) -> type[DynamicSchedulePolicyBase]:
    """The policy class for a registered name or a ``package.module:Class`` path."""
    if not isinstance(value, str) or not value.strip():
        raise PolicyError(f"dynamic_schedule_policy must be a policy name or 'package.module:Class', "
                          f"got {value!r}")
    if ":" not in value:
        try:
            return _REGISTRY[value]
        except KeyError:
            known = ", ".join(sorted(_REGISTRY)) or "none"
            raise PolicyError(f"unknown dynamic_schedule_policy {value!r}; registered policies: {known}; "
                              f"or give an import path 'package.module:Class'") from None
    module_name, _, class_name = value.partition(":")
    if not module_name or not class_name:
        raise PolicyError(f"dynamic_schedule_policy {value!r} is not of the form 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise PolicyError(f"cannot import module {module_name!r} of dynamic_schedule_policy {value!r}: "
                          f"{type(err).__name__}: {err}") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PolicyError(f"module {module_name!r} has no attribute {class_name!r} "
                          f"(dynamic_schedule_policy {value!r})")
    if not (isinstance(cls, type) and issubclass(cls, DynamicSchedulePolicyBase)):
        raise PolicyError(f"dynamic_schedule_policy {value!r} is {cls!r}, not a subclass of "
                          f"DynamicSchedulePolicyBase")
    return cls


def create_policy(name: str, deactivate_ratio: float = 0.3, only_hybrid: bool = False,
                  **params: Any) -> DynamicSchedulePolicyBase:
    """Instantiate the policy ``name`` as ``cls(deactivate_ratio=..., only_hybrid=..., **params)``."""
    cls = resolve_policy(name)
    factory: Callable[..., DynamicSchedulePolicyBase] = cls   # subclasses take the reference's arguments
    try:
        policy = factory(deactivate_ratio=deactivate_ratio, only_hybrid=only_hybrid, **params)
    except PolicyError:
        raise
    except (TypeError, ValueError) as err:
        extra = f" with parameters {sorted(params)}" if params else ""
        raise PolicyError(f"cannot create dynamic_schedule_policy {name!r} ({_qualified(cls)}){extra}: "
                          f"{err}") from err
    return policy


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
