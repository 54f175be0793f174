"""What a policy written for verl reaches outside its own class, provided so that it runs unchanged.

verl's built-in policies (``verl/experimental/fully_async_policy/dynamic_schedule``)
do two things beyond the policy API:

* their module does ``import ray`` at the top, and
* ``request_rebalance`` performs the rebalance itself, through the rollouter
  handle verl's ``DynamicResourceController`` injects as ``policy._rollouter``:
  ``ray.get(self._rollouter.rebalance_requests.remote(reset_prefix_cache=...))``.

rollmesh needs no Ray, so:

* :func:`import_policy_module` imports a policy's module; when ``ray`` cannot
  be imported it makes a stand-in module answer ``import ray`` for the
  duration of that import only (the stand-in is removed from ``sys.modules``
  afterwards, so nothing else in the process believes Ray is installed);
* :func:`bind_ray` points the ``ray`` global of every module that defines a
  class in the policy's MRO at :class:`RayShim`: ``ray.get`` of a value that
  :class:`RolloutHandle` returned gives that value; anything else goes to the
  real Ray when it is installed and otherwise raises a clear error. A real
  ``ray.get`` on a non-Ray object would start a local Ray cluster; the shim
  never does;
* :class:`RolloutHandle` is what rollmesh injects as ``policy._rollouter``.
  ``rebalance_requests.remote(reset_prefix_cache=True)`` records the request
  and returns at once; the controller performs its own rebalance (clear
  sticky sessions, move in-flight requests toward the new replicas) right
  after ``request_rebalance`` returns, because the policy call is synchronous
  and the rebalance awaits the load balancer. The value it returns says so:
  ``{"scheduled": True, "reset_prefix_cache": ...}`` (no ``cleared_entries``
  yet: the lifecycle event of the rebalance carries the real counts).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from mesh_runtime.stand_ins import import_with_stand_ins

_STAND_IN_MARK = "__rollmesh_ray_stand_in__"


class RemoteValue:
    """What ``.remote()`` of a :class:`RolloutHandle` method returns: a resolved "object ref"."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"RemoteValue({self.value!r})"


class _RemoteMethod:
    """``handle.method.remote(...)`` and ``handle.method(...)`` both call ``fn``."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> RemoteValue:
        return RemoteValue(self._fn(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class RolloutHandle:
    """The ``policy._rollouter`` rollmesh injects: records rebalance requests of verl-style policies."""

    def __init__(self) -> None:
        self.rebalance_requested = False
        self.reset_prefix_cache = True

    def clear(self) -> None:
        """Forget the previous request (called before each ``request_rebalance``)."""
        self.rebalance_requested = False
        self.reset_prefix_cache = True

    def _rebalance(self, reset_prefix_cache: bool = True, **_ignored: Any) -> dict[str, Any]:
        self.rebalance_requested = True
        self.reset_prefix_cache = bool(reset_prefix_cache)
        return {"scheduled": True, "reset_prefix_cache": self.reset_prefix_cache}

    @property
    def rebalance_requests(self) -> _RemoteMethod:
        """verl's ``FullyAsyncRollouter.rebalance_requests``."""
        return _RemoteMethod(self._rebalance)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the rollouter handle rollmesh gives policies offers only rebalance_requests; "
                             f"{name!r} is a verl rollouter method rollmesh does not provide")


class RayShim:
    """A ``ray`` for policy modules: resolves :class:`RemoteValue`, delegates the rest to real Ray if any."""

    def __init__(self, real: types.ModuleType | None) -> None:
        self._real = real

    def get(self, refs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(refs, RemoteValue):
            return refs.value
        if isinstance(refs, list) and refs and all(isinstance(r, RemoteValue) for r in refs):
            return [r.value for r in refs]
        if self._real is not None:
            return self._real.get(refs, *args, **kwargs)
        raise RuntimeError("ray.get of an object rollmesh did not create: Ray is not installed, and rollmesh "
                           "resolves only the rollouter handle's rebalance_requests.remote() results")

    def __getattr__(self, name: str) -> Any:
        if self._real is not None:
            return getattr(self._real, name)
        raise AttributeError(f"ray.{name}: Ray is not installed; rollmesh's stand-in offers only ray.get "
                             f"for the rebalance calls of verl-style policies")


def _ray_importable() -> bool:
    if "ray" in sys.modules:
        return not getattr(sys.modules["ray"], _STAND_IN_MARK, False)
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def _stand_in() -> types.ModuleType:
    module = types.ModuleType("ray", "rollmesh's stand-in for Ray while a policy module is imported")
    setattr(module, _STAND_IN_MARK, True)
    shim = RayShim(None)
    module.get = shim.get  # type: ignore[attr-defined]
    return module


def import_policy_module(name: str) -> types.ModuleType:
    """``importlib.import_module(name)``, with ``import ray`` answered by a stand-in when Ray is absent."""
    if _ray_importable():
        return importlib.import_module(name)
    return import_with_stand_ins(name, {"ray": _stand_in()})


def bind_ray(cls: type) -> None:
    """Point the ``ray`` global of the modules defining ``cls`` and its bases at a :class:`RayShim`."""
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or not hasattr(module, "ray"):
            continue
        current = module.ray
        if isinstance(current, RayShim):
            continue
        if isinstance(current, types.ModuleType) and current.__name__ == "ray":
            real = None if getattr(current, _STAND_IN_MARK, False) else current
            setattr(module, "ray", RayShim(real))
