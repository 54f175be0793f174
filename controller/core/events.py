"""Lifecycle events and the controller's bounded event log.

``LifecycleEvent`` mirrors ``rollmesh.controller.v1.LifecycleEvent`` field by
field; enum-valued fields hold the proto's full value names as strings
(``from_state="REPLICA_STATE_ACTIVE"``, ``replica_kind="REPLICA_KIND_HYBRID"``)
so the gRPC layer maps them with ``Enum.Value(name)``. ``EventType`` members
carry the same names via ``.proto_name``.

``EventLog`` is pure: it numbers events (1, 2, 3, ... - continuing after
:meth:`EventLog.restore`), keeps the newest ``max_events`` of them and
answers ``since(sequence)`` with the retained events and how many were
missed. Watchers and streaming are the gRPC layer's business. Anything that
produces events takes an :data:`EventSink` - ``EventLog.append`` is one.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from mesh_runtime.json_values import from_struct, to_struct
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2


class EventType(enum.Enum):
    """What an event is about (``rollmesh.controller.v1.EventType`` without the prefix)."""

    REPLICA_STATE_CHANGED = "REPLICA_STATE_CHANGED"
    CONTROLLER_STATE_CHANGED = "CONTROLLER_STATE_CHANGED"
    WEIGHT_SYNC_STARTED = "WEIGHT_SYNC_STARTED"
    WEIGHT_SYNC_COMPLETED = "WEIGHT_SYNC_COMPLETED"
    WEIGHT_SYNC_SKIPPED = "WEIGHT_SYNC_SKIPPED"
    WEIGHT_SYNC_FAILED = "WEIGHT_SYNC_FAILED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    NODE_REGISTERED = "NODE_REGISTERED"
    NODE_DEREGISTERED = "NODE_DEREGISTERED"
    OPERATION_STATE_CHANGED = "OPERATION_STATE_CHANGED"
    AUTOSCALER_DECISION = "AUTOSCALER_DECISION"
    STEP_PHASE = "STEP_PHASE"
    WAIT_EXPIRED = "WAIT_EXPIRED"
    GAP = "GAP"
    REPLICA_EJECTED = "REPLICA_EJECTED"
    LEADER_CHANGED = "LEADER_CHANGED"
    BALANCER_REGISTERED = "BALANCER_REGISTERED"
    BALANCER_DEREGISTERED = "BALANCER_DEREGISTERED"
    BALANCER_LEASE_EXPIRED = "BALANCER_LEASE_EXPIRED"

    @property
    def proto_name(self) -> str:
        """The full proto enum value name, e.g. ``EVENT_TYPE_STEP_PHASE``."""
        return f"EVENT_TYPE_{self.value}"


@dataclasses.dataclass(frozen=True)
class LifecycleEvent:
    """One transition in the mesh (see ``controller/v1/events.proto``)."""

    sequence: int
    time: float
    """Seconds on the controller's clock."""
    type: EventType
    replica_id: str = ""
    node_id: str = ""
    replica_kind: str = ""
    """Full ``ReplicaKind`` value name, or empty."""
    from_state: str = ""
    to_state: str = ""
    reason: str = ""
    trace_id: str = ""
    span_id: str = ""
    global_step: int | None = None
    weight_version: int | None = None
    operation_id: str = ""
    attributes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """``details`` as strings (the contract's ``attributes``)."""
    missed_events: int = 0
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The details with their JSON types: str, int, float, bool, or a list of them."""

    def to_document(self) -> state_pb2.Event:
        """The event as the store keeps it (``Event`` in the state schema)."""
        return state_pb2.Event(
            sequence=self.sequence, time=self.time, type=self.type.value, replica_id=self.replica_id,
            node_id=self.node_id, replica_kind=self.replica_kind, from_state=self.from_state,
            to_state=self.to_state, reason=self.reason, trace_id=self.trace_id, span_id=self.span_id,
            global_step=self.global_step, weight_version=self.weight_version, operation_id=self.operation_id,
            attributes=self.attributes, missed_events=self.missed_events, details=to_struct(self.details))

    @classmethod
    def from_document(cls, doc: state_pb2.Event) -> LifecycleEvent:
        # an event saved before details existed keeps its strings as its details
        details = from_struct(doc.details) if doc.HasField("details") else dict(doc.attributes)
        return cls(
            sequence=doc.sequence, time=doc.time, type=EventType(doc.type), replica_id=doc.replica_id,
            node_id=doc.node_id, replica_kind=doc.replica_kind, from_state=doc.from_state, to_state=doc.to_state,
            reason=doc.reason, trace_id=doc.trace_id, span_id=doc.span_id,
            global_step=doc.global_step if doc.HasField("global_step") else None,
            weight_version=doc.weight_version if doc.HasField("weight_version") else None,
            operation_id=doc.operation_id, attributes=dict(doc.attributes), missed_events=doc.missed_events,
            details=details)


_WARNING_TYPES = frozenset({EventType.LEASE_EXPIRED, EventType.WEIGHT_SYNC_FAILED, EventType.WAIT_EXPIRED,
                            EventType.GAP, EventType.REPLICA_EJECTED, EventType.BALANCER_LEASE_EXPIRED})


def _short(state: str) -> str:
    return state.removeprefix("REPLICA_STATE_").removeprefix("OPERATION_STATE_").removeprefix("HYBRID_STATE_")


def log_event(event: LifecycleEvent, logger: logging.Logger) -> None:
    """One log line per event: INFO, WARNING for lost leases, failed syncs, ejections and replicas FAILED.

    The line names the subject, the transition and its reason; the event's
    fields go along as structured fields (``extra``) for JSON logs.
    """
    failed = event.to_state.endswith("FAILED")
    level = logging.WARNING if event.type in _WARNING_TYPES or failed else logging.INFO
    subject = " ".join(part for part in (
        f"replica {event.replica_id}" if event.replica_id else "",
        f"node {event.node_id}" if event.node_id and not event.replica_id else "",
        f"operation {event.operation_id}" if event.operation_id else "") if part)
    transition = (f"{_short(event.from_state)} -> {_short(event.to_state)}".strip()
                  if event.from_state or event.to_state else "")
    text = " ".join(part for part in (event.type.value, subject, transition) if part)
    fields = {"event_sequence": event.sequence, "event_type": event.type.value}
    for key in ("replica_id", "node_id", "operation_id", "global_step", "weight_version"):
        value = getattr(event, key)
        if value not in ("", None):
            fields[key] = value
    logger.log(level, "%s%s", text, f": {event.reason}" if event.reason else "", extra=fields)


class EventSink(Protocol):
    """Anything that records an event: ``sink(EventType.X, replica_id=..., ...)``."""

    def __call__(self, type: EventType, /, **fields: Any) -> Any: ...


Clock = Callable[[], float]
TraceIds = Callable[[], tuple[str, str]]


def _no_trace() -> tuple[str, str]:
    return "", ""


class EventLog:
    """Numbered, bounded, restorable history of lifecycle events.

    Retention is by count and by age: the newest ``max_events`` are always
    kept, older ones too while they are younger than ``max_age_s`` (so a
    registration storm of a large fleet does not evict what a watcher that
    connected a minute ago still needs), and never more than ``hard_max``.
    """

    def __init__(self, clock: Clock, *, max_events: int = 10_000, max_age_s: float | None = None,
                 hard_max: int | None = None, trace_ids: TraceIds = _no_trace) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be > 0, got {max_events}")
        self._clock = clock
        self._trace_ids = trace_ids
        self.max_events = max_events
        self.max_age_s = max_age_s
        self.hard_max = max(hard_max or max_events, max_events)
        self._events: collections.deque[LifecycleEvent] = collections.deque()
        self._next_sequence = 1

    @property
    def last_sequence(self) -> int:
        """Sequence of the newest event ever appended (0 before the first)."""
        return self._next_sequence - 1

    @property
    def first_retained_sequence(self) -> int:
        """Sequence of the oldest event still held (``last_sequence + 1`` when empty)."""
        return self._events[0].sequence if self._events else self._next_sequence

    def append(self, type: EventType, /, *, attributes: Mapping[str, object] | None = None,
               time: float | None = None, **fields: Any) -> LifecycleEvent:
        """Record an event; time and trace ids default to the clock and the current span."""
        if not fields.get("trace_id"):
            fields["trace_id"], fields["span_id"] = self._trace_ids()
        details = {str(k): _detail(v) for k, v in (attributes or {}).items() if v is not None}
        event = LifecycleEvent(
            sequence=self._next_sequence, time=self._clock() if time is None else time, type=type,
            attributes={k: _attr(v) for k, v in details.items()}, details=details, **fields)
        self._next_sequence += 1
        self._events.append(event)
        self._trim(event.time)
        return event

    def _trim(self, now: float) -> None:
        events = self._events
        while len(events) > self.hard_max:
            events.popleft()
        if len(events) <= self.max_events:
            return
        horizon = None if self.max_age_s is None else now - self.max_age_s
        while len(events) > self.max_events and (horizon is None or events[0].time < horizon):
            events.popleft()

    __call__ = append

    def since(self, sequence: int) -> tuple[list[LifecycleEvent], int]:
        """Events with ``sequence >= sequence`` still retained, and how many of them were dropped.

        ``sequence`` 0 or 1 means "from the beginning". The second value
        counts events in ``[sequence, first retained)`` that fell out of the
        bounded history, so a watcher can emit an EVENT_TYPE_GAP for them.
        """
        start = max(1, int(sequence))
        first = self.first_retained_sequence
        missed = max(0, min(first, self._next_sequence) - start)
        # retained sequences are consecutive: skip to the start instead of scanning the whole history
        return list(itertools.islice(self._events, max(0, start - first), None)), missed

    def __len__(self) -> int:
        return len(self._events)

    def to_document(self) -> state_pb2.EventsDocument:
        """The event numbering as the store keeps it; the events themselves are rows of their own table."""
        return state_pb2.EventsDocument(next_sequence=self._next_sequence)

    def restore(self, document: state_pb2.EventsDocument, events: Iterable[state_pb2.Event]) -> None:
        """Restore the numbering and the stored ``events`` (oldest first); later events continue the numbering
        after the restored ones."""
        self._events.clear()
        for event in events:
            self._events.append(LifecycleEvent.from_document(event))
        if self._events:
            self._trim(self._clock())
        restored_next = document.next_sequence if document.HasField("next_sequence") else 1
        newest = self._events[-1].sequence + 1 if self._events else 1
        self._next_sequence = max(restored_next, newest)


def _attr(value: object) -> str:
    """A detail (a JSON value, see :func:`_detail`) as the string the contract's ``attributes`` map holds."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(_attr(v) for v in value)
    return str(value)


def _detail(value: object) -> Any:
    """A detail as a JSON value (what the contract's ``details`` Struct holds)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_detail(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_detail(v) for v in value)
    return str(value)
