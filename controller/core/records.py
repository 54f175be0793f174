"""What the registry holds: replica kinds and states, the transitions allowed between states, and the
records of replicas and nodes (with their persisted form: ``Replica`` and ``Node`` of
``proto/rollmesh/controller/state/v1/documents.proto``).

The state machine itself (who may move a replica where, with which event)
is :class:`~controller.core.replicas.ReplicaRegistry`; this module is its
vocabulary, shared by the controller's core, its adapters and the simulator.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .leases import Lease


class ReplicaKind(enum.Enum):
    """Which GPU pool a replica runs on (``rollmesh.common.v1.ReplicaKind``)."""

    STANDALONE = "STANDALONE"
    HYBRID = "HYBRID"

    @property
    def proto_name(self) -> str:
        return f"REPLICA_KIND_{self.value}"


class ReplicaState(enum.Enum):
    """Lifecycle state of one replica (``rollmesh.common.v1.ReplicaState``)."""

    LAUNCHING = "LAUNCHING"
    LOADING = "LOADING"
    SYNCING = "SYNCING"
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    DRAINING = "DRAINING"
    SLEEPING = "SLEEPING"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    REMOVED = "REMOVED"

    @property
    def proto_name(self) -> str:
        return f"REPLICA_STATE_{self.value}"


S = ReplicaState
ALLOWED_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    # A new engine must load (and possibly sync) before it may serve.
    S.LAUNCHING: frozenset({S.LOADING, S.FAILED, S.STOPPED}),
    S.LOADING: frozenset({S.SYNCING, S.ACTIVE, S.PAUSED, S.SLEEPING, S.FAILED, S.STOPPED}),
    # After a sync the replica serves, waits paused, or (hybrid sync undone) sleeps again.
    S.SYNCING: frozenset({S.ACTIVE, S.PAUSED, S.SLEEPING, S.FAILED, S.STOPPED}),
    # Leaving service always passes DRAINING (removed from routing, requests aborted).
    S.ACTIVE: frozenset({S.SYNCING, S.PAUSED, S.DRAINING, S.FAILED, S.STOPPED}),
    S.PAUSED: frozenset({S.ACTIVE, S.SYNCING, S.DRAINING, S.FAILED, S.STOPPED}),
    S.DRAINING: frozenset({S.SLEEPING, S.ACTIVE, S.FAILED, S.STOPPED}),
    # Waking goes through PAUSED, so a replica is routed before it is resumed.
    S.SLEEPING: frozenset({S.SYNCING, S.PAUSED, S.FAILED, S.STOPPED}),
    S.FAILED: frozenset({S.LAUNCHING, S.STOPPED, S.REMOVED}),
    S.STOPPED: frozenset({S.LAUNCHING, S.REMOVED}),
    S.REMOVED: frozenset(),
}
TERMINAL_STATES = frozenset({S.FAILED, S.STOPPED, S.REMOVED})
"""States in which no engine process serves or holds memory on the controller's behalf."""


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """One replica as an agent reports it when registering its node."""

    replica_id: str
    kind: ReplicaKind
    state: ReplicaState = S.LAUNCHING
    weight_version: int = 0
    slots: tuple[int, ...] = ()
    memory_fraction: float = 0.0
    initial: bool = False
    engine_url: str = ""
    """The running engine server the replica is attached to (external SGLang); empty otherwise."""
    data_address: str = ""
    """The replica's own process, which serves its generations; empty when the node's agent does."""


@dataclasses.dataclass
class ReplicaRecord:
    """The controller's record of one replica (``ReplicaRecord`` in registry.proto)."""

    replica_id: str
    node_id: str
    address: str
    kind: ReplicaKind
    state: ReplicaState
    weight_version: int = 0
    slots: tuple[int, ...] = ()
    memory_fraction: float = 0.0
    initial: bool = False
    added_by_operation_id: str = ""
    intentionally_removed: bool = False
    state_reason: str = ""
    model_name: str = "default"
    lease_expires_at: float | None = None
    updated_at: float = 0.0
    added_at: float = 0.0
    """When the replica first entered the registry (scale-in picks the newest first)."""
    engine_url: str = ""
    """The running engine server the replica is attached to (external SGLang); empty otherwise."""
    data_address: str = ""
    """The replica's own process, which serves its generations; empty when the node's agent does."""
    last_report: Any = dataclasses.field(default=None, compare=False)
    """The latest load report, opaque to the core; not persisted."""

    def to_document(self) -> state_pb2.Replica:
        return state_pb2.Replica(
            replica_id=self.replica_id, node_id=self.node_id, address=self.address, kind=self.kind.value,
            state=self.state.value, weight_version=self.weight_version, slots=self.slots,
            memory_fraction=self.memory_fraction, initial=self.initial,
            added_by_operation_id=self.added_by_operation_id, intentionally_removed=self.intentionally_removed,
            state_reason=self.state_reason, model_name=self.model_name, lease_expires_at=self.lease_expires_at,
            updated_at=self.updated_at, added_at=self.added_at, engine_url=self.engine_url,
            data_address=self.data_address)

    @classmethod
    def from_document(cls, doc: state_pb2.Replica) -> ReplicaRecord:
        return cls(
            replica_id=doc.replica_id, node_id=doc.node_id, address=doc.address, kind=ReplicaKind(doc.kind),
            state=ReplicaState(doc.state), weight_version=doc.weight_version, slots=tuple(doc.slots),
            memory_fraction=doc.memory_fraction, initial=doc.initial,
            added_by_operation_id=doc.added_by_operation_id, intentionally_removed=doc.intentionally_removed,
            state_reason=doc.state_reason, model_name=doc.model_name,
            lease_expires_at=doc.lease_expires_at if doc.HasField("lease_expires_at") else None,
            updated_at=doc.updated_at, added_at=doc.added_at, engine_url=doc.engine_url,
            data_address=doc.data_address)

    @property
    def route_address(self) -> str:
        """Where balancers send the replica's generations: its own process, else its node's agent."""
        return self.data_address or self.address


@dataclasses.dataclass
class NodeRecord:
    """The controller's record of one registered node."""

    node_id: str
    address: str
    slots_total: int = 0
    backend: str = ""
    model: str = ""
    model_name: str = "default"
    agent_version: str = ""
    registered_at: float = 0.0
    last_report_at: float | None = None
    external: bool = False
    """Connected by an external scale-out: the controller polls its load reports to hold the lease."""
    lease: Lease = dataclasses.field(default_factory=Lease)
    """The node's lease (:mod:`controller.core.leases`): held while its agent reports."""

    @property
    def lease_held(self) -> bool:
        return self.lease.held

    @property
    def lease_expires_at(self) -> float:
        return self.lease.expires_at

    def to_document(self) -> state_pb2.Node:
        return state_pb2.Node(
            node_id=self.node_id, address=self.address, slots_total=self.slots_total, backend=self.backend,
            model=self.model, model_name=self.model_name, agent_version=self.agent_version,
            registered_at=self.registered_at, last_report_at=self.last_report_at, external=self.external,
            lease_expires_at=self.lease.expires_at, lease_held=self.lease.held)

    @classmethod
    def from_document(cls, doc: state_pb2.Node) -> NodeRecord:
        return cls(
            node_id=doc.node_id, address=doc.address, slots_total=doc.slots_total, backend=doc.backend,
            model=doc.model, model_name=doc.model_name, agent_version=doc.agent_version,
            registered_at=doc.registered_at,
            last_report_at=doc.last_report_at if doc.HasField("last_report_at") else None,
            external=doc.external,
            lease=Lease(expires_at=doc.lease_expires_at, held=doc.lease_held if doc.HasField("lease_held") else True))


@dataclasses.dataclass(frozen=True)
class Registration:
    """Outcome of :meth:`ReplicaRegistry.register_node`."""

    node_id: str
    accepted: tuple[str, ...]
    rejected: dict[str, str]
    """Refused replica id -> why."""
    lease_expires_at: float
