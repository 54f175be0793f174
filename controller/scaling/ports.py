"""What a scale operation's body (:mod:`controller.scaling.runs`) uses, as a port: :class:`ScaleHost`, which
:class:`~controller.scaling.scaler.Scaler` provides with the controller's parts the
:class:`~controller.mesh.Mesh` wires into it."""

from __future__ import annotations

import asyncio
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..agents import AgentCalls
    from ..config import ControllerConfig
    from ..core.events import EventType
    from ..core.records import ReplicaRecord
    from ..core.replicas import ReplicaRegistry
    from ..routing import Routing
    from ..store import StateStore
    from ..weight_sync import WeightBroadcast
    from .operations import OperationState, ScaleOperation


class ScaleHost(Protocol):
    """What a scale operation's body uses of the scaler that runs it: the controller's parts it was given
    (explicit ports, wired by the :class:`~controller.mesh.Mesh`) and its bookkeeping."""

    config: ControllerConfig
    calls: AgentCalls
    store: StateStore
    registry: ReplicaRegistry
    routing: Routing
    weights: WeightBroadcast
    transitions: asyncio.Lock
    """Held around every change of routing or weights, by hybrid transitions and scale operations alike."""

    def clock(self) -> float: ...

    def emit(self, type: EventType, /, **fields: Any) -> Any: ...

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]: ...

    removing: set[str]
    """Replicas a scale-in is taking out: routed by no rule meanwhile."""

    async def save(self) -> None: ...

    async def move(self, op: ScaleOperation, state: OperationState, reason: str = "") -> None: ...

    def blocks_routing(self, record: ReplicaRecord) -> bool: ...

    def current_version(self, model_name: str, exclude: AbstractSet[str] = frozenset()) -> int | None: ...
