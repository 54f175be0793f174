"""Scale operations as resources: their states, the allowed transitions and the book that holds them.

A :class:`ScaleOperation` mirrors ``rollmesh.controller.v1.ScaleOperation``
(the reference's scale-out / scale-in request records). Every state change
goes through :meth:`OperationBook.transition`, which checks
:data:`ALLOWED` and emits an OPERATION_STATE_CHANGED event, so the event
stream holds each operation's exact state sequence.

Scale-out: PENDING -> CREATING (native) | CONNECTING (external) ->
HEALTH_CHECKING -> WEIGHT_SYNCING -> READY -> ACTIVE, FAILED or CANCELLED
before ACTIVE. Scale-in: PENDING -> DRAINING -> REMOVING -> COMPLETED,
FAILED from any of them, CANCELLED only from PENDING. NOOP is recorded at
creation when there was nothing to do.

The book also answers the two guarantees that need the whole history: which
operation is running now (one at a time) and which operation a client
``request_id`` created (idempotent retries). Pure: no I/O, injected clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from mesh_runtime.reasons import Reason
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from ..core.errors import CoreError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from ..core.events import EventSink, EventType


class OperationType(enum.Enum):
    SCALE_OUT = "SCALE_OUT"
    SCALE_IN = "SCALE_IN"

    @property
    def proto_name(self) -> str:
        return f"OPERATION_TYPE_{self.value}"


class OperationState(enum.Enum):
    PENDING = "PENDING"
    CREATING = "CREATING"
    CONNECTING = "CONNECTING"
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    READY = "READY"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    REMOVING = "REMOVING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NOOP = "NOOP"

    @property
    def proto_name(self) -> str:
        return f"OPERATION_STATE_{self.value}"


OS = OperationState
TERMINAL = frozenset({OS.ACTIVE, OS.COMPLETED, OS.FAILED, OS.CANCELLED, OS.NOOP})
_OUT_END = frozenset({OS.FAILED, OS.CANCELLED})
ALLOWED: dict[OperationType, dict[OperationState, frozenset[OperationState]]] = {
    OperationType.SCALE_OUT: {
        OS.PENDING: frozenset({OS.CREATING, OS.CONNECTING}) | _OUT_END,
        OS.CREATING: frozenset({OS.HEALTH_CHECKING}) | _OUT_END,
        OS.CONNECTING: frozenset({OS.HEALTH_CHECKING}) | _OUT_END,
        OS.HEALTH_CHECKING: frozenset({OS.WEIGHT_SYNCING}) | _OUT_END,
        OS.WEIGHT_SYNCING: frozenset({OS.READY}) | _OUT_END,
        OS.READY: frozenset({OS.ACTIVE}) | _OUT_END,
    },
    OperationType.SCALE_IN: {
        OS.PENDING: frozenset({OS.DRAINING, OS.FAILED, OS.CANCELLED}),
        OS.DRAINING: frozenset({OS.REMOVING, OS.FAILED}),
        OS.REMOVING: frozenset({OS.COMPLETED, OS.FAILED}),
    },
}


def cancellable(op: ScaleOperation) -> bool:
    """Scale-out before ACTIVE; scale-in only while PENDING."""
    if op.state in TERMINAL:
        return False
    return op.type is OperationType.SCALE_OUT or op.state is OS.PENDING


class OperationInProgress(CoreError):
    """Another scale operation runs; ``metadata['operation_id']`` names it."""

    code = "ABORTED"
    default_reason = Reason.SCALE_OPERATION_IN_PROGRESS


class RequestIdReused(CoreError):
    code = "ALREADY_EXISTS"
    default_reason = Reason.REQUEST_ID_REUSED


@dataclasses.dataclass
class StateChange:
    state: OperationState
    at: float
    reason: str = ""


@dataclasses.dataclass
class ScaleOperation:
    """One scale-out or scale-in request and its progress (``ScaleOperation`` in scaling.proto)."""

    operation_id: str
    type: OperationType
    state: OperationState
    model_name: str = "default"
    num_replicas: int = 0
    engine_addresses: list[str] = dataclasses.field(default_factory=list)
    replica_ids: list[str] = dataclasses.field(default_factory=list)
    failed_replica_ids: list[str] = dataclasses.field(default_factory=list)
    created_at: float = 0.0
    updated_at: float = 0.0
    error_message: str = ""
    weight_version: int | None = None
    force: bool = False
    dry_run: bool = False
    timeout_s: float = 0.0
    partial_success_policy: str = "rollback_all"
    state_history: list[StateChange] = dataclasses.field(default_factory=list)
    triggered_by: str = "user"
    request_id: str = ""
    fingerprint: str = ""
    """The request's parameters, to tell a retry from a reuse of its request_id."""
    engines_before: int = 0
    """Replicas of the model when the operation was accepted (history records)."""
    launched_replica_ids: list[str] = dataclasses.field(default_factory=list)
    """Replicas the operation launched itself (a rollback stops them on their agents)."""

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_document(self) -> state_pb2.ScaleOperation:
        return state_pb2.ScaleOperation(
            operation_id=self.operation_id, type=self.type.value, state=self.state.value,
            model_name=self.model_name, num_replicas=self.num_replicas, engine_addresses=self.engine_addresses,
            replica_ids=self.replica_ids, failed_replica_ids=self.failed_replica_ids, created_at=self.created_at,
            updated_at=self.updated_at, error_message=self.error_message, weight_version=self.weight_version,
            force=self.force, dry_run=self.dry_run, timeout_s=self.timeout_s,
            partial_success_policy=self.partial_success_policy,
            state_history=[state_pb2.OperationStateChange(state=c.state.value, at=c.at, reason=c.reason)
                           for c in self.state_history],
            triggered_by=self.triggered_by, request_id=self.request_id, fingerprint=self.fingerprint,
            engines_before=self.engines_before, launched_replica_ids=self.launched_replica_ids)

    @classmethod
    def from_document(cls, doc: state_pb2.ScaleOperation) -> ScaleOperation:
        return cls(
            operation_id=doc.operation_id, type=OperationType(doc.type), state=OperationState(doc.state),
            model_name=doc.model_name, num_replicas=doc.num_replicas, engine_addresses=list(doc.engine_addresses),
            replica_ids=list(doc.replica_ids), failed_replica_ids=list(doc.failed_replica_ids),
            created_at=doc.created_at, updated_at=doc.updated_at, error_message=doc.error_message,
            weight_version=doc.weight_version if doc.HasField("weight_version") else None, force=doc.force,
            dry_run=doc.dry_run, timeout_s=doc.timeout_s, partial_success_policy=doc.partial_success_policy,
            state_history=[StateChange(OperationState(c.state), c.at, c.reason) for c in doc.state_history],
            triggered_by=doc.triggered_by, request_id=doc.request_id, fingerprint=doc.fingerprint,
            engines_before=doc.engines_before, launched_replica_ids=list(doc.launched_replica_ids))


class OperationBook:
    """Every scale operation by id, newest last; the running one; request-id index."""

    def __init__(self, *, clock: Callable[[], float], emit: EventSink | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self._clock = clock
        self._emit = emit or (lambda *a, **k: None)
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self._ops: dict[str, ScaleOperation] = {}
        self._waiters: set[asyncio.Future[None]] = set()

    def _wake(self) -> None:
        """Wake every :meth:`wait` (an operation changed)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, operation_id: str, timeout_s: float | None) -> ScaleOperation:
        """The operation once it has finished, or as it is after ``timeout_s`` (None: no limit); NOT_FOUND as
        :meth:`get`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        op = self.get(operation_id)
        while not op.finished:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait({waiter}, timeout=left)   # woken by a change, or the time is up
            finally:
                self._waiters.discard(waiter)
            op = self.get(operation_id)
        return op

    def new(self, type: OperationType, *, state: OperationState = OS.PENDING, reason: str = "",
            store: bool = True, **fields: Any) -> ScaleOperation:
        """Create an operation in ``state`` (PENDING, or NOOP); stored unless a dry run."""
        now = self._clock()
        op = ScaleOperation(operation_id=self._new_id(), type=type, state=state, created_at=now, updated_at=now,
                            state_history=[StateChange(state, now, reason)], **fields)
        if store:
            self._ops[op.operation_id] = op
            self._wake()
            self._emit(EventType.OPERATION_STATE_CHANGED, operation_id=op.operation_id, from_state="",
                       to_state=state.proto_name, reason=reason,
                       attributes={"type": type.value, "model_name": op.model_name,
                                   "triggered_by": op.triggered_by})
        return op

    def get(self, operation_id: str) -> ScaleOperation:
        if not operation_id:
            raise InvalidArgumentError("operation_id must not be empty", reason=Reason.EMPTY_OPERATION_ID)
        try:
            return self._ops[operation_id]
        except KeyError:
            raise NotFoundError(f"no scale operation {operation_id!r}", reason=Reason.OPERATION_NOT_FOUND,
                                metadata={"operation_id": operation_id}) from None

    def __contains__(self, operation_id: object) -> bool:
        return operation_id in self._ops

    def list(self, *, states: Iterable[OperationState] = (), types: Iterable[OperationType] = (),
             model_name: str = "") -> list[ScaleOperation]:
        """Matching operations, newest first."""
        states, types = set(states), set(types)
        ops = sorted(self._ops.values(), key=lambda o: (o.created_at, o.operation_id), reverse=True)
        return [o for o in ops if (not states or o.state in states) and (not types or o.type in types)
                and (not model_name or o.model_name == model_name)]

    def running(self) -> ScaleOperation | None:
        """The operation that has not finished yet (there is at most one)."""
        return next((o for o in self._ops.values() if not o.finished), None)

    def check_idle(self) -> None:
        """Raise ABORTED naming the running operation, if there is one."""
        op = self.running()
        if op is not None:
            raise OperationInProgress(
                f"scale operation {op.operation_id} ({op.type.value}, {op.state.value}) is still running; "
                "wait for it to finish or cancel it, then retry", metadata={"operation_id": op.operation_id})

    def by_request_id(self, request_id: str, fingerprint: str) -> ScaleOperation | None:
        """The operation a retry of ``request_id`` refers to; ALREADY_EXISTS for other parameters."""
        if not request_id:
            return None
        for op in self._ops.values():
            if op.request_id == request_id:
                if op.fingerprint != fingerprint:
                    raise RequestIdReused(f"request_id {request_id!r} was used by operation {op.operation_id} "
                                          "with other parameters; use a new request_id",
                                          metadata={"operation_id": op.operation_id})
                return op
        return None

    def transition(self, op: ScaleOperation, to: OperationState, reason: str = "", *,
                   wake: bool = True) -> ScaleOperation:
        """Move ``op`` to ``to`` (FAILED_PRECONDITION unless :data:`ALLOWED`) and emit the event; ``wake=False``
        leaves the :meth:`wait` callers asleep until :meth:`wake` (the scaler wakes them once the new state is
        stored, so a finished wait is never answered with a state a crash could take back)."""
        if op.state is to:
            return op
        if to not in ALLOWED[op.type].get(op.state, frozenset()):
            raise FailedPreconditionError(
                f"scale operation {op.operation_id} cannot go from {op.state.value} to {to.value}",
                reason=Reason.INVALID_OPERATION_TRANSITION, metadata={"operation_id": op.operation_id})
        previous = op.state
        op.state = to
        op.updated_at = self._clock()
        op.state_history.append(StateChange(to, op.updated_at, reason))
        if to in (OS.FAILED, OS.CANCELLED) and reason and not op.error_message:
            op.error_message = reason
        self._emit(EventType.OPERATION_STATE_CHANGED, operation_id=op.operation_id,
                   from_state=previous.proto_name, to_state=to.proto_name, reason=reason,
                   weight_version=op.weight_version,
                   attributes={"type": op.type.value, "replica_ids": list(op.replica_ids),
                               "failed_replica_ids": list(op.failed_replica_ids)})
        if wake:
            self._wake()
        return op

    def wake(self) -> None:
        """Wake every :meth:`wait` now (after a transition made with ``wake=False`` is stored)."""
        self._wake()

    def delete(self, operation_id: str) -> None:
        """Forget a finished operation (NOT_FOUND as :meth:`get`; FAILED_PRECONDITION while it runs); a later
        request with its request_id creates a new operation."""
        op = self.get(operation_id)
        if not op.finished:
            raise FailedPreconditionError(f"scale operation {operation_id} is {op.state.value}: only a finished "
                                          "operation can be deleted; cancel it or wait for it first",
                                          reason=Reason.OPERATION_NOT_FINISHED,
                                          metadata={"operation_id": operation_id, "state": op.state.value})
        del self._ops[operation_id]
        self._wake()

    def touch(self, op: ScaleOperation) -> None:
        op.updated_at = self._clock()

    # --- persistence ---

    def to_document(self) -> state_pb2.OperationsDocument:
        return state_pb2.OperationsDocument(operations=[o.to_document() for o in self.list()])

    def restore(self, document: state_pb2.OperationsDocument) -> None:
        self._ops = {}
        for item in document.operations:
            op = ScaleOperation.from_document(item)
            self._ops[op.operation_id] = op
        self._wake()
