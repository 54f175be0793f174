"""Policy registry: ``register_policy``, name / import-path resolution, ``create_policy``.

``dynamic_schedule_policy`` is either a registered name (``"default"``,
``"static_fully_async"``, ``"fixed_ratio"``, ``"balanced"``,
``"reference_example"`` or one added with ``@register_policy``) or an import
path ``package.module:ClassName``; the latter needs no registration step at
all, which is how verl's own classes are loaded, e.g.
``verl.experimental.fully_async_policy.dynamic_schedule.default_policy:DefaultDynamicSchedulePolicy``.

A policy is any class with the reference's three required methods (see
:mod:`.handle`); it need not derive from rollmesh's base class. Modules are
imported through :func:`~.verl_compat.import_policy_module`, so a module that
does ``import ray`` loads without Ray installed. Anything unusable raises
:class:`~controller.core.errors.PolicyError` naming the offending value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import PolicyError
from .handle import check_policy_class
from .verl_compat import bind_ray, import_policy_module

_REGISTRY: dict[str, type] = {}

P = TypeVar("P", bound=type)


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make ``cls`` available as ``dynamic_schedule_policy: name``.

    Registering a second, different class under a taken name is an error;
    registering the same class again (a module re-import) is allowed.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise PolicyError(f"policy name must be a non-empty string without ':', got {name!r}")

    def decorate(cls: P) -> P:
        check_policy_class(cls, f"@register_policy({name!r})")
        taken = _REGISTRY.get(name)
        if taken is not None and _qualified(taken) != _qualified(cls):
            raise PolicyError(f"policy name {name!r} is already registered for {_qualified(taken)}; "
                              f"pick another name for {_qualified(cls)}")
        _REGISTRY[name] = cls
        return cls

    return decorate


def registered_policies() -> dict[str, type]:
    """A copy of the name -> class registry."""
    return dict(_REGISTRY)


def resolve_policy(value: str) -> type:
    """The policy class for a registered name or a ``package.module:Class`` path."""
    if not isinstance(value, str) or not value.strip():
        raise PolicyError(f"dynamic_schedule_policy must be a policy name or 'package.module:Class', "
                          f"got {value!r}")
    if ":" not in value:
        try:
            cls: Any = _REGISTRY[value]
            bind_ray(cls)
            return cls
        except KeyError:
            known = ", ".join(sorted(_REGISTRY)) or "none"
            raise PolicyError(f"unknown dynamic_schedule_policy {value!r}; registered policies: {known}; "
                              f"or give an import path 'package.module:Class'") from None
    module_name, _, class_name = value.partition(":")
    if not module_name or not class_name:
        raise PolicyError(f"dynamic_schedule_policy {value!r} is not of the form 'package.module:Class'")
    try:
        module = import_policy_module(module_name)
    except Exception as err:
        raise PolicyError(f"cannot import module {module_name!r} of dynamic_schedule_policy {value!r}: "
                          f"{type(err).__name__}: {err}") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PolicyError(f"module {module_name!r} has no attribute {class_name!r} "
                          f"(dynamic_schedule_policy {value!r})")
    check_policy_class(cls, f"dynamic_schedule_policy {value!r}")
    bind_ray(cls)
    return cls


def create_policy(name: str, deactivate_ratio: float = 0.3, only_hybrid: bool = False,
                  **params: Any) -> Any:
    """Instantiate the policy ``name`` as ``cls(deactivate_ratio=..., only_hybrid=..., **params)``."""
    cls = resolve_policy(name)
    factory: Callable[..., Any] = cls   # policies take the reference's (and verl's build_policy) arguments
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
