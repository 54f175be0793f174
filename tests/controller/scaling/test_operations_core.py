"""The pure operation book: transitions, events, one running operation, request-id retries, persistence."""

from __future__ import annotations

import pytest

from controller.core.errors import CoreError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from controller.core.events import EventLog, EventType
from controller.scaling.operations import (
    OperationBook, OperationInProgress, OperationState, OperationType, RequestIdReused, cancellable)

OS = OperationState


def book():
    clock = iter(range(1000)).__next__
    log = EventLog(lambda: 0.0)
    ids = iter(f"op{i}" for i in range(100)).__next__
    return OperationBook(clock=clock, emit=log.append, new_id=ids), log


def test_scale_out_path_is_recorded_as_events_and_history():
    b, log = book()
    op = b.new(OperationType.SCALE_OUT, num_replicas=3)
    for state in (OS.CREATING, OS.HEALTH_CHECKING, OS.WEIGHT_SYNCING, OS.READY, OS.ACTIVE):
        b.transition(op, state, f"to {state.value}")
    assert [c.state for c in op.state_history] == [OS.PENDING, OS.CREATING, OS.HEALTH_CHECKING, OS.WEIGHT_SYNCING,
                                                   OS.READY, OS.ACTIVE]
    events = [e for e in log.since(0)[0] if e.type is EventType.OPERATION_STATE_CHANGED]
    assert [e.to_state for e in events] == [f"OPERATION_STATE_{s}" for s in
                                            ("PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY",
                                             "ACTIVE")]
    assert events[2].from_state == "OPERATION_STATE_CREATING" and all(e.operation_id == "op0" for e in events)
    assert op.finished and not cancellable(op)


@pytest.mark.parametrize("type_, start, to", [
    (OperationType.SCALE_OUT, OS.PENDING, OS.DRAINING),
    (OperationType.SCALE_OUT, OS.CREATING, OS.ACTIVE),
    (OperationType.SCALE_IN, OS.PENDING, OS.CREATING),
    (OperationType.SCALE_IN, OS.DRAINING, OS.CANCELLED),
    (OperationType.SCALE_IN, OS.REMOVING, OS.DRAINING),
])
def test_forbidden_transitions_are_refused(type_, start, to):
    b, _ = book()
    op = b.new(type_)
    op.state = start
    with pytest.raises(FailedPreconditionError):
        b.transition(op, to)
    assert op.state is start


def test_terminal_states_allow_nothing():
    b, _ = book()
    op = b.new(OperationType.SCALE_IN)
    b.transition(op, OS.FAILED, "boom")
    assert op.error_message == "boom"
    for state in OS:
        if state is not OS.FAILED:
            with pytest.raises(FailedPreconditionError):
                b.transition(op, state)


def test_one_running_operation_and_cancellable_states():
    b, _ = book()
    b.check_idle()
    b.new(OperationType.SCALE_OUT, state=OS.NOOP)
    b.check_idle()  # a NOOP never runs
    op = b.new(OperationType.SCALE_IN)
    assert cancellable(op)
    with pytest.raises(OperationInProgress) as info:
        b.check_idle()
    assert info.value.code == "ABORTED" and info.value.metadata == {"operation_id": op.operation_id}
    b.transition(op, OS.DRAINING)
    assert not cancellable(op)  # scale-in only while PENDING
    out = b.new(OperationType.SCALE_OUT)
    out.state = OS.READY
    assert cancellable(out)


def test_request_id_retries_and_reuse():
    b, _ = book()
    op = b.new(OperationType.SCALE_OUT, request_id="k", fingerprint="a")
    assert b.by_request_id("k", "a") is op
    assert b.by_request_id("", "a") is None and b.by_request_id("other", "a") is None
    with pytest.raises(RequestIdReused) as info:
        b.by_request_id("k", "b")
    assert info.value.code == "ALREADY_EXISTS"


def test_lookup_listing_and_round_trip():
    b, _ = book()
    first = b.new(OperationType.SCALE_OUT, model_name="m1")
    second = b.new(OperationType.SCALE_IN, model_name="m2", replica_ids=["r1"])
    b.transition(first, OS.CONNECTING)
    with pytest.raises(NotFoundError):
        b.get("nope")
    with pytest.raises(InvalidArgumentError):
        b.get("")
    assert [o.operation_id for o in b.list()] == [second.operation_id, first.operation_id]
    assert b.list(states=[OS.CONNECTING]) == [first]
    assert b.list(types=[OperationType.SCALE_IN], model_name="m2") == [second]
    assert b.list(model_name="m3") == []
    restored, _ = book()
    restored.restore(b.to_document())
    again = restored.get(first.operation_id)
    assert again == first and restored.get(second.operation_id).replica_ids == ["r1"]
    assert isinstance(FailedPreconditionError("x"), CoreError)
