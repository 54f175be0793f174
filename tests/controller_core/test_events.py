"""EventLog: numbering, bounded retention, gaps, restore, trace ids."""

from __future__ import annotations

import pytest

from controller.core import EventLog, EventType, LifecycleEvent

from .fakes import FakeClock

pytestmark = pytest.mark.timeout(60)


def test_sequence_increases_and_time_comes_from_the_clock():
    clock = FakeClock(5.0)
    log = EventLog(clock)
    a = log.append(EventType.STEP_PHASE, global_step=1, attributes={"phase": "begin", "ok": True, "x": 0.5})
    clock.advance(2)
    b = log(EventType.WAIT_EXPIRED, reason="late")
    assert (a.sequence, b.sequence) == (1, 2) and (a.time, b.time) == (5.0, 7.0)
    assert a.attributes == {"phase": "begin", "ok": "true", "x": "0.5"}
    assert EventType.WAIT_EXPIRED.proto_name == "EVENT_TYPE_WAIT_EXPIRED"
    assert log.last_sequence == 2


def test_bounded_retention_and_gap_counts():
    log = EventLog(FakeClock(), max_events=3)
    for i in range(5):
        log.append(EventType.STEP_PHASE, global_step=i)
    events, missed = log.since(0)
    assert [e.sequence for e in events] == [3, 4, 5] and missed == 2
    events, missed = log.since(2)
    assert [e.sequence for e in events] == [3, 4, 5] and missed == 1
    events, missed = log.since(4)
    assert [e.sequence for e in events] == [4, 5] and missed == 0
    events, missed = log.since(6)
    assert events == [] and missed == 0


def test_restore_continues_numbering():
    log = EventLog(FakeClock(), max_events=10)
    for _ in range(4):
        log.append(EventType.NODE_REGISTERED, node_id="n1")
    stored = [e.to_document() for e in log.since(1)[0]]   # the events table's rows
    restored = EventLog(FakeClock())
    restored.restore(log.to_document(), stored)
    assert restored.append(EventType.NODE_DEREGISTERED).sequence == 5
    assert [e.sequence for e in restored.since(1)[0]] == [1, 2, 3, 4, 5]
    bare = EventLog(FakeClock())
    bare.restore(log.to_document(), [])
    assert bare.append(EventType.GAP).sequence == 5 and bare.since(1)[1] == 4


def test_event_document_round_trip_and_trace_ids():
    log = EventLog(FakeClock(), trace_ids=lambda: ("a" * 32, "b" * 16))
    event = log.append(EventType.REPLICA_STATE_CHANGED, replica_id="r1", from_state="REPLICA_STATE_ACTIVE",
                       to_state="REPLICA_STATE_DRAINING", weight_version=3,
                       attributes={"attempts": 3, "ratio": 0.5, "ids": ["a", "b"], "forced": True})
    assert event.trace_id == "a" * 32 and event.span_id == "b" * 16
    again = LifecycleEvent.from_document(event.to_document())
    assert again == event and again.details == {"attempts": 3, "ratio": 0.5, "ids": ["a", "b"], "forced": True}
    assert type(again.details["attempts"]) is int and again.global_step is None   # as they were, through the Struct


def test_retention_keeps_young_events_past_the_count_and_never_more_than_the_hard_bound():
    now = [1000.0]
    log = EventLog(lambda: now[0], max_events=10, max_age_s=60, hard_max=50)
    for _ in range(30):                       # a storm: 30 events within a second
        log.append(EventType.NODE_REGISTERED, node_id="n")
    assert len(log) == 30                     # all younger than 60 s: a watcher a minute behind misses none
    events, missed = log.since(1)
    assert missed == 0 and [e.sequence for e in events] == list(range(1, 31))
    now[0] += 61
    log.append(EventType.NODE_REGISTERED, node_id="n")
    assert len(log) == 10 and log.first_retained_sequence == 22   # old ones fall back to the count
    for _ in range(100):
        log.append(EventType.NODE_REGISTERED, node_id="n")
    assert len(log) == 50                     # the hard bound, whatever their age
    events, missed = log.since(100)
    assert [e.sequence for e in events] == list(range(100, 132)) and missed == 0
    assert log.since(1)[1] == 81
