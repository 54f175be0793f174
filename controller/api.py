"""What the controller's servers use of the mesh they serve from: one typed port.

The gRPC surface (:mod:`controller.service`, :mod:`controller.scaling.service`, :mod:`controller.scaling.lro`)
decodes a request, calls an operation of :class:`ControllerApi` or of a feature it names, and encodes the answer.
It holds no :class:`~controller.mesh.Mesh`: :class:`~controller.leadership.Leadership` hands it the mesh it
serves from now (the leader's, or a standby's read-only copy) as this protocol, and the Mesh, the composition
root, is what implements it. What an RPC changes goes through an operation here or through a feature's own
operation (the scaler, the weight requests, the balancer registry), never by reaching into the members the
composition root wired together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rollmesh.common.v1 import load_pb2
    from rollmesh.controller.v1 import registry_pb2

    from .balancers import Balancers
    from .core.hybrid import DynamicResourceController
    from .core.metrics import CycleMetrics
    from .core.records import Registration
    from .core.replicas import ReplicaRegistry
    from .core.steps import BeginDecision, CompleteResult, ReleaseResult, StepReport
    from .scaling.autoscaler_loop import AutoscalerLoop
    from .scaling.scaler import Scaler
    from .watchers import EventHub
    from .weight_requests import WeightRequests


class ControllerApi(Protocol):
    """The controller as its RPCs see it: the operations of the composition root and the features it wired."""

    registry: ReplicaRegistry
    """The replicas and nodes (reads; every change goes through an operation that persists and routes it)."""
    scheduler: DynamicResourceController
    """The hybrid scheduler (its state; the step protocol through :meth:`begin_step` and the two after it)."""
    weight_requests: WeightRequests
    """SyncWeights, LoadWeights, UpdateWeightsFromGroup."""
    balancers: Balancers
    """The load balancers' registry."""
    hub: EventHub
    """Event streams."""
    metrics: CycleMetrics
    """Closed sync cycles."""
    scaler: Scaler
    """Scale operations."""
    autoscaler: AutoscalerLoop
    """The autoscaler."""
    clock: Callable[[], float]
    """The controller's clock, seconds."""

    @property
    def state_store(self) -> str:
        """Where the durable state lives, in words."""
        ...

    @property
    def last_event_sequence(self) -> int:
        """Sequence of the newest event (0 before the first)."""
        ...

    def balancer_addresses(self) -> list[str]:
        """Every load balancer routed (configured and registered)."""
        ...

    def admit(self) -> float:
        """Seconds a registration must wait under ``max_registrations_per_s``; 0 to go ahead now."""
        ...

    def pace(self) -> tuple[float, float]:
        """The fleet's load-report interval and lease TTL, seconds."""
        ...

    async def register_node(self, request: registry_pb2.RegisterNodeRequest) -> Registration:
        """Register a node and its replicas, route them, persist it; checks the request first."""
        ...

    def renew(self, node_id: str, reports: Sequence[load_pb2.LoadReport]) -> tuple[float, bool]:
        """Renew a node's lease from its load reports: (expires at, must register again)."""
        ...

    async def deregister_node(self, node_id: str, reason: str) -> list[str]:
        """Stop a node's replicas, take them out of routing, persist it; the replicas stopped."""
        ...

    async def begin_step(self, global_step: int, report: StepReport) -> BeginDecision:
        ...

    async def release_hybrid(self, global_step: int, buffered_samples: int, waited_s: float,
                             wait_expired: bool) -> ReleaseResult:
        ...

    async def complete_step(self, global_step: int, weight_version: int, report: StepReport) -> CompleteResult:
        ...
