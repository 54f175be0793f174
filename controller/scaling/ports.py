"""What a scale operation uses, as ports: of the controller (:class:`ScalingMesh`, which
:class:`~controller.mesh.Mesh` provides) and, in its body (:mod:`controller.scaling.runs`), of the scaler that
runs it (:class:`ScaleHost`, which :class:`~controller.scaling.scaler.Scaler` provides)."""

from __future__ import annotations

import asyncio
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..agents import AgentCalls
    from ..config import ControllerConfig
    from ..core.events import EventType
    from ..core.hybrid import DynamicResourceController
    from ..core.records import ReplicaRecord
    from ..core.replicas import ReplicaRegistry
    from ..ports import Channels
    from ..routing import Routing
    from ..store import StateStore
    from ..weight_sync import WeightBroadcast
    from .operations import OperationState, ScaleOperation


class ScalingMesh(Protocol):
    """What scale operations use of the controller (its :class:`~controller.mesh.Mesh` provides it)."""

    config: ControllerConfig
    store: StateStore
    channels: Channels
    registry: ReplicaRegistry
    routing: Routing
    weights: WeightBroadcast
    scheduler: DynamicResourceController
    transitions: asyncio.Lock
    """Held around every change of routing or weights, by hybrid transitions and scale operations alike."""

    def clock(self) -> float: ...

    def emit(self, type: EventType, /, **fields: Any) -> Any: ...

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[Any]: ...

    def renew(self, node_id: str, reports: Any) -> tuple[float, bool]: ...


class ScaleHost(Protocol):
    """What a scale operation's body uses of the scaler that runs it."""

    mesh: ScalingMesh
    config: ControllerConfig
    calls: AgentCalls
    removing: set[str]
    """Replicas a scale-in is taking out: routed by no rule meanwhile."""

    async def save(self) -> None: ...

    async def move(self, op: ScaleOperation, state: OperationState, reason: str = "") -> None: ...

    def blocks_routing(self, record: ReplicaRecord) -> bool: ...

    def current_version(self, model_name: str, exclude: AbstractSet[str] = frozenset()) -> int | None: ...
