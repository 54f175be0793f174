"""Registry of nodes and replicas, with the per-replica state machine and leases.

Every change of a replica's state goes through :meth:`ReplicaRegistry.transition`,
which checks :data:`ALLOWED_TRANSITIONS` and emits a REPLICA_STATE_CHANGED
event. The one other writer is node registration, which *records* what an
agent observes after a restart (the agent is the authority on a process that
survived the controller); it too emits an event per change, and refuses
replicas that a scale-in removed on purpose.

Counting follows the reference's ``get_active_server_count()``: a replica
serves rollout when it is ACTIVE; each replica is one record keyed by id, so
it is counted once, and a hybrid replica is only ever counted as hybrid.

Leases: a node holds a lease of ``lease_ttl_s`` from registration and from
each :meth:`ReplicaRegistry.renew`; :meth:`ReplicaRegistry.expire_leases`
marks the replicas of nodes whose lease ran out FAILED ("lease expired").
A node whose lease expired must register again. After a restore the
controller gives every node a fresh lease, so agents have time to reconnect.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .errors import InvalidArgumentError, InvalidTransition, NotFoundError
from .events import Clock, EventSink, EventType
from .leases import Lessor
from .records import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    NodeRecord,
    Registration,
    ReplicaKind,
    ReplicaRecord,
    ReplicaSpec,
    ReplicaState,
)

S = ReplicaState


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    return None


class ReplicaRegistry:
    """Nodes, replicas, leases and the replica state machine."""

    def __init__(self, *, clock: Clock, emit: EventSink | None = None, lease_ttl_s: float = 10.0) -> None:
        self._clock = clock
        self._emit: EventSink = emit or _ignore
        self.leases = Lessor(lease_ttl_s, clock)
        """The nodes' leases (:mod:`controller.core.leases`)."""
        self._nodes: dict[str, NodeRecord] = {}
        self._replicas: dict[str, ReplicaRecord] = {}
        self._by_node: dict[str, set[str]] = {}
        """node id -> its replica ids: a lease renewal or a per-node lookup touches only that node's replicas."""
        self._dirty: set[str] = set()
        """Node ids whose durable record (the node and its replicas) changed since :meth:`take_changes`."""

    def _put(self, record: ReplicaRecord) -> None:
        """Store ``record`` and keep the per-node index in line (a replica may move to another node)."""
        previous = self._replicas.get(record.replica_id)
        if previous is not None and previous.node_id != record.node_id:
            self._by_node.get(previous.node_id, set()).discard(record.replica_id)
            self._dirty.add(previous.node_id)
        self._dirty.add(record.node_id)
        self._replicas[record.replica_id] = record
        self._by_node.setdefault(record.node_id, set()).add(record.replica_id)

    def _pop(self, replica_id: str) -> ReplicaRecord:
        record = self._replicas.pop(replica_id)
        self._dirty.add(record.node_id)
        ids = self._by_node.get(record.node_id)
        if ids is not None:
            ids.discard(replica_id)
            if not ids:
                del self._by_node[record.node_id]
        return record

    @property
    def lease_ttl_s(self) -> float:
        return self.leases.ttl_s

    # --- nodes and leases ---

    def register_node(self, node_id: str, address: str, *, replicas: Sequence[ReplicaSpec] = (),
                      slots_total: int = 0, backend: str = "", model: str = "",
                      model_name: str = "default", agent_version: str = "",
                      now: float | None = None) -> Registration:
        """Replace the node's record with this registration and take over its replicas."""
        if not node_id or not address:
            raise InvalidArgumentError("register_node needs a node_id and an address")
        now = self._clock() if now is None else now
        seen = [spec.replica_id for spec in replicas]
        if len(seen) != len(set(seen)):
            raise InvalidArgumentError(f"registration of node {node_id!r} repeats a replica id: {seen}")
        lease = self.leases.grant(now)
        expires = lease.expires_at
        self._dirty.add(node_id)
        self._nodes[node_id] = NodeRecord(node_id=node_id, address=address, slots_total=slots_total,
                                          backend=backend, model=model, model_name=model_name or "default",
                                          agent_version=agent_version, registered_at=now, lease=lease)
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        for spec in replicas:
            why = self._refusal(node_id, spec)
            if why:
                rejected[spec.replica_id] = why
                continue
            self._adopt(node_id, address, model_name or "default", spec, expires, now)
            accepted.append(spec.replica_id)
        for record in self.replicas(node_id=node_id):
            if record.replica_id not in seen and record.state not in TERMINAL_STATES:
                self.transition(record.replica_id, S.FAILED,
                                f"missing from the re-registration of node {node_id}")
        for record in self.replicas(node_id=node_id):
            record.lease_expires_at = expires
        self._emit(EventType.NODE_REGISTERED, node_id=node_id, reason="node registered",
                   attributes={"accepted": len(accepted), "rejected": len(rejected), "address": address})
        return Registration(node_id, tuple(accepted), rejected, expires)

    def deregister_node(self, node_id: str, reason: str = "") -> list[str]:
        """Stop the node's replicas and forget the node; returns the replicas stopped."""
        self.node(node_id)
        stopped = []
        for record in self.replicas(node_id=node_id):
            if record.state not in (S.STOPPED, S.REMOVED):
                self.transition(record.replica_id, S.STOPPED, reason or f"node {node_id} deregistered")
                stopped.append(record.replica_id)
        del self._nodes[node_id]
        self._dirty.add(node_id)
        self._emit(EventType.NODE_DEREGISTERED, node_id=node_id, reason=reason or "node deregistered")
        return stopped

    def renew(self, node_id: str, now: float | None = None) -> float:
        """Extend the node's lease by ``lease_ttl_s`` from ``now``; returns the new expiry.

        Not a durable change: a restored node that held its lease gets a fresh one, so a renewal is
        never written (at thousands of reports a second that would be all the controller does)."""
        node = self.node(node_id)
        now = self._clock() if now is None else now
        expires = self.leases.renew(node.lease, "node", node_id, now)
        node.last_report_at = now
        for record in self.replicas(node_id=node_id):
            record.lease_expires_at = expires
        return expires

    def expire_leases(self, now: float | None = None) -> list[ReplicaRecord]:
        """Mark FAILED the live replicas of every node whose lease ran out; returns them."""
        failed: list[ReplicaRecord] = []
        nodes = sorted(self._nodes.values(), key=lambda n: n.node_id)
        for node in self.leases.lapse(((n, n.lease) for n in nodes), now):
            self._dirty.add(node.node_id)
            self._emit(EventType.LEASE_EXPIRED, node_id=node.node_id, reason="lease expired",
                       attributes={"lease_expires_at": node.lease_expires_at})
            for record in self.replicas(node_id=node.node_id):
                if record.state not in TERMINAL_STATES:
                    failed.append(self.transition(record.replica_id, S.FAILED, "lease expired"))
        return failed

    def node(self, node_id: str) -> NodeRecord:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise NotFoundError(f"node {node_id!r} is not registered") from None

    def node_count(self) -> int:
        return len(self._nodes)

    def nodes(self) -> list[NodeRecord]:
        return [self._nodes[key] for key in sorted(self._nodes)]

    # --- replicas ---

    def add_replica(self, spec: ReplicaSpec, *, node_id: str, operation_id: str = "",
                    reason: str = "") -> ReplicaRecord:
        """Add a new replica (e.g. a scale-out launch) on a registered node."""
        node = self.node(node_id)
        existing = self._replicas.get(spec.replica_id)
        if existing is not None and existing.state is not S.REMOVED:
            raise InvalidArgumentError(f"replica {spec.replica_id!r} already exists "
                                       f"(state {existing.state.value}, node {existing.node_id})")
        if existing is not None and existing.intentionally_removed:
            raise InvalidArgumentError(f"replica id {spec.replica_id!r} was removed by a scale-in; "
                                       f"use a new id")
        record = ReplicaRecord(replica_id=spec.replica_id, node_id=node_id, address=node.address,
                               kind=spec.kind, state=spec.state, weight_version=spec.weight_version,
                               slots=tuple(spec.slots), memory_fraction=spec.memory_fraction,
                               initial=spec.initial, added_by_operation_id=operation_id,
                               model_name=node.model_name, lease_expires_at=node.lease_expires_at,
                               updated_at=self._clock(), added_at=self._clock(), state_reason=reason or "added",
                               engine_url=spec.engine_url, data_address=spec.data_address)
        self._put(record)
        self._emit_change(record, "", record.state_reason, operation_id=operation_id)
        return record

    def transition(self, replica_id: str, to_state: ReplicaState, reason: str = "",
                   **event_fields: Any) -> ReplicaRecord:
        """Move a replica to ``to_state`` or raise :class:`InvalidTransition`.

        A move to the state the replica is already in changes nothing and
        emits nothing. ``event_fields`` (global_step, weight_version,
        operation_id, attributes) go into the emitted event.
        """
        record = self.get(replica_id)
        if record.state is to_state:
            return record
        if to_state not in ALLOWED_TRANSITIONS[record.state]:
            raise InvalidTransition(replica_id, record.state.proto_name, to_state.proto_name, reason)
        previous = record.state
        record.state = to_state
        record.state_reason = reason
        record.updated_at = self._clock()
        self._dirty.add(record.node_id)
        self._emit_change(record, previous.proto_name, reason, **event_fields)
        return record

    def can_transition(self, replica_id: str, to_state: ReplicaState) -> bool:
        record = self.get(replica_id)
        return record.state is to_state or to_state in ALLOWED_TRANSITIONS[record.state]

    def mark_removed(self, replica_id: str, reason: str, *, operation_id: str = "") -> ReplicaRecord:
        """Scale-in removal: REMOVED, and never taken back on re-registration."""
        record = self.transition(replica_id, S.REMOVED, reason, operation_id=operation_id)
        record.intentionally_removed = True
        self._dirty.add(record.node_id)
        return record

    def forget_node(self, node_id: str, reason: str) -> list[str]:
        """Drop a node and every replica record on it (an external connection rolled back)."""
        self.node(node_id)
        gone = [r.replica_id for r in self.replicas(node_id=node_id)]
        for replica_id in gone:
            record = self._pop(replica_id)
            self._emit(EventType.REPLICA_STATE_CHANGED, replica_id=replica_id, node_id=node_id,
                       replica_kind=record.kind.proto_name, from_state=record.state.proto_name,
                       to_state=S.REMOVED.proto_name, reason=reason)
        del self._nodes[node_id]
        self._dirty.add(node_id)
        self._emit(EventType.NODE_DEREGISTERED, node_id=node_id, reason=reason)
        return gone

    def set_weight_version(self, replica_id: str, version: int) -> None:
        record = self.get(replica_id)
        record.weight_version = int(version)
        record.updated_at = self._clock()
        self._dirty.add(record.node_id)

    def record_report(self, replica_id: str, report: Any) -> None:
        """Keep the latest load report of a replica (opaque to the core)."""
        self.get(replica_id).last_report = report

    def get(self, replica_id: str) -> ReplicaRecord:
        try:
            return self._replicas[replica_id]
        except KeyError:
            raise NotFoundError(f"replica {replica_id!r} is not in the registry") from None

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def replicas(self, *, kind: ReplicaKind | None = None, states: Iterable[ReplicaState] | None = None,
                 node_id: str | None = None) -> list[ReplicaRecord]:
        """Replicas matching every given filter, ordered by id (with ``node_id``: only that node's are looked at)."""
        wanted = None if states is None else frozenset(states)
        keys = sorted(self._replicas) if node_id is None else sorted(self._by_node.get(node_id, ()))
        return [self._replicas[key] for key in keys
                if (kind is None or self._replicas[key].kind is kind)
                and (wanted is None or self._replicas[key].state in wanted)]

    def active_count(self, kind: ReplicaKind | None = None) -> int:
        """ACTIVE replicas of ``kind`` (all kinds when None), each counted once."""
        return sum(1 for r in self._replicas.values()
                   if r.state is S.ACTIVE and (kind is None or r.kind is kind))

    def present_and_active(self) -> tuple[int, int]:
        """(replicas not REMOVED, ACTIVE replicas) in one pass over the registry, without sorting (GetStatus)."""
        present = active = 0
        for record in self._replicas.values():
            state = record.state
            if state is not S.REMOVED:
                present += 1
                active += state is S.ACTIVE
        return present, active

    def get_active_server_count(self) -> int:
        """Replicas serving rollout now, standalone plus active hybrid (the reference's name)."""
        return self.active_count()

    def counts(self) -> dict[str, dict[str, int]]:
        """Replica counts by kind and state, e.g. ``counts()["HYBRID"]["SLEEPING"]``."""
        table = {kind.value: {state.value: 0 for state in ReplicaState} for kind in ReplicaKind}
        for record in self._replicas.values():
            table[record.kind.value][record.state.value] += 1
        return table

    # --- persistence ---

    def touch(self, node_id: str) -> None:
        """Mark the record of ``node_id`` changed (after changing one of its fields directly)."""
        self._dirty.add(node_id)

    def take_changes(self) -> list[tuple[str, state_pb2.NodeDocument | None]]:
        """(node id, its document or None when nothing of it is left) for each node changed since the last
        call: O(the changed nodes' replicas), never the fleet."""
        changed, self._dirty = sorted(self._dirty), set()
        return [(node_id, self.node_document(node_id)) for node_id in changed]

    def node_document(self, node_id: str) -> state_pb2.NodeDocument | None:
        """The durable record of one node: the node (unset once deregistered) and every replica on it."""
        node = self._nodes.get(node_id)
        replicas = self.replicas(node_id=node_id)
        if node is None and not replicas:
            return None
        return state_pb2.NodeDocument(node=node.to_document() if node else None,
                                      replicas=[r.to_document() for r in replicas])

    def documents(self) -> list[state_pb2.NodeDocument]:
        """Every node's document (a whole snapshot; the store writes the changed ones only)."""
        ids = sorted({*self._nodes, *(r.node_id for r in self._replicas.values())})
        return [doc for doc in map(self.node_document, ids) if doc is not None]

    @classmethod
    def from_documents(cls, documents: Iterable[state_pb2.NodeDocument], *, clock: Clock,
                       emit: EventSink | None = None, lease_ttl_s: float = 10.0,
                       now: float | None = None) -> ReplicaRegistry:
        """Restore from :meth:`node_document` documents; every node that held a lease gets a fresh one."""
        documents = list(documents)
        registry = cls.restore([d.node for d in documents if d.HasField("node")],
                               [r for d in documents for r in d.replicas],
                               clock=clock, emit=emit, lease_ttl_s=lease_ttl_s, now=now)
        registry._dirty.clear()   # as stored
        return registry

    @classmethod
    def restore(cls, nodes: Iterable[state_pb2.Node], replicas: Iterable[state_pb2.Replica], *, clock: Clock,
                emit: EventSink | None = None, lease_ttl_s: float = 10.0,
                now: float | None = None) -> ReplicaRegistry:
        """A registry of these records, each marked changed; every node that held a lease gets a fresh one
        from ``now``."""
        registry = cls(clock=clock, emit=emit, lease_ttl_s=lease_ttl_s)
        now = clock() if now is None else now
        for node_doc in nodes:
            node = NodeRecord.from_document(node_doc)
            registry.leases.restore(node.lease, now)
            registry._nodes[node.node_id] = node
        for replica_doc in replicas:
            record = ReplicaRecord.from_document(replica_doc)
            owner = registry._nodes.get(record.node_id)
            record.lease_expires_at = owner.lease_expires_at if owner else record.lease_expires_at
            registry._put(record)
        return registry

    # --- internals ---

    def _refusal(self, node_id: str, spec: ReplicaSpec) -> str:
        existing = self._replicas.get(spec.replica_id)
        if spec.state is S.REMOVED:
            return "an agent cannot report a replica as REMOVED"
        if existing is None:
            return ""
        if existing.intentionally_removed:
            return f"removed on purpose ({existing.state_reason or 'scale-in'}); stop it"
        if existing.node_id != node_id and existing.state not in TERMINAL_STATES:
            return f"registered on node {existing.node_id} in state {existing.state.value}"
        return ""

    def _adopt(self, node_id: str, address: str, model_name: str, spec: ReplicaSpec,
               expires: float, now: float) -> None:
        existing = self._replicas.get(spec.replica_id)
        record = ReplicaRecord(
            replica_id=spec.replica_id, node_id=node_id, address=address, kind=spec.kind,
            state=spec.state, weight_version=spec.weight_version, slots=tuple(spec.slots),
            memory_fraction=spec.memory_fraction,
            initial=(spec.initial or (existing.initial if existing else False))
            and not (existing and existing.added_by_operation_id),
            added_by_operation_id=existing.added_by_operation_id if existing else "",
            model_name=model_name, lease_expires_at=expires, updated_at=now,
            added_at=existing.added_at if existing else now, engine_url=spec.engine_url,
            data_address=spec.data_address,
            state_reason="registered" if existing is None else "reported by agent on registration")
        self._put(record)
        if existing is None or existing.state is not record.state:
            self._emit_change(record, existing.state.proto_name if existing else "", record.state_reason)

    def _emit_change(self, record: ReplicaRecord, from_state: str, reason: str, **fields: Any) -> None:
        self._emit(EventType.REPLICA_STATE_CHANGED, replica_id=record.replica_id, node_id=record.node_id,
                   replica_kind=record.kind.proto_name, from_state=from_state,
                   to_state=record.state.proto_name, reason=reason, **fields)
