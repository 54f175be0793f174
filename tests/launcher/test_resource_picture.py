"""The resource-time picture: segments derived from events, and the PNG it writes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.resource_picture import TRAINER_ROW, build_picture, event_dict_from_proto, render_resource_picture

SA, HY = "REPLICA_KIND_STANDALONE", "REPLICA_KIND_HYBRID"


def _ev(seq, t, type_, **fields):
    return {"sequence": seq, "time": t, "type": type_, "replica_id": "", "replica_kind": "", "from_state": "",
            "to_state": "", "global_step": None, "attributes": {}, **fields}


def _state(seq, t, rid, kind, to):
    return _ev(seq, t, "REPLICA_STATE_CHANGED", replica_id=rid, replica_kind=kind, to_state=f"REPLICA_STATE_{to}")


def _phase(seq, t, step, phase, **attrs):
    return _ev(seq, t, "STEP_PHASE", global_step=step, attributes={"phase": phase, **attrs})


def two_steps():
    """Step 1 deactivates the hybrid (wait 100-102, train 102-110, sync 110-112); step 2 keeps it asleep."""
    return [
        _state(1, 100.0, "sa-0", SA, "ACTIVE"),
        _state(2, 100.0, "hy-0", HY, "ACTIVE"),
        _phase(3, 100.0, 1, "begin", deactivate="true"),
        _state(4, 102.0, "hy-0", HY, "SLEEPING"),
        _phase(5, 102.0, 1, "release"),
        _ev(6, 110.0, "WEIGHT_SYNC_STARTED", global_step=1),
        _state(7, 110.0, "sa-0", SA, "SYNCING"),
        _state(8, 112.0, "sa-0", SA, "ACTIVE"),
        _ev(9, 112.0, "WEIGHT_SYNC_COMPLETED", global_step=1),
        _phase(10, 112.0, 1, "complete"),
        _phase(11, 113.0, 2, "begin", deactivate="false"),
        _ev(12, 120.0, "WEIGHT_SYNC_STARTED", global_step=2),
        _ev(13, 121.0, "WEIGHT_SYNC_COMPLETED", global_step=2),
        _phase(14, 121.0, 2, "complete"),
    ]


def test_segments_follow_the_events():
    pic = build_picture(two_steps())
    assert pic.rows == ("sa-0", "hy-0", TRAINER_ROW)
    assert pic.origin == 100.0 and pic.duration == 21.0
    assert pic.step_starts == ((1, 0.0), (2, 13.0))
    # the standalone replica: rollout except for its 2 s weight sync
    assert pic.time_in("sa-0", "weight_sync") == pytest.approx(2.0)
    assert pic.time_in("sa-0", "rollout") == pytest.approx(21.0 - 2.0)
    # the hybrid: rollout until released, then asleep to the end
    assert pic.time_in("hy-0", "rollout") == pytest.approx(2.0)
    assert pic.time_in("hy-0", "sleep") == pytest.approx(19.0)
    # the trainer: waits 2 s, trains 8 s, syncs 2 s; step 2 trains 7 s and syncs 1 s
    assert pic.time_in(TRAINER_ROW, "wait") == pytest.approx(2.0)
    assert pic.time_in(TRAINER_ROW, "train") == pytest.approx(8.0 + 7.0)
    assert pic.time_in(TRAINER_ROW, "weight_sync") == pytest.approx(3.0)


def test_explicit_activities_override_their_span():
    pic = build_picture(two_steps(), activities=[{"row": TRAINER_ROW, "start": 113.0, "end": 116.0,
                                                  "activity": "wait"}])
    assert pic.time_in(TRAINER_ROW, "wait") == pytest.approx(2.0 + 3.0)
    assert pic.time_in(TRAINER_ROW, "train") == pytest.approx(8.0 + 4.0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no events"):
        build_picture([])
    with pytest.raises(ValueError, match="unknown activity 'dance'"):
        build_picture(two_steps(), activities=[{"row": "x", "start": 0, "end": 1, "activity": "dance"}])


def test_png_has_one_row_per_replica_and_the_trainer(tmp_path):
    from PIL import Image

    out = tmp_path / "resources.png"
    pic = render_resource_picture(two_steps(), str(out), title="two steps")
    with Image.open(out) as img:
        assert img.format == "PNG"
        assert img.size[0] > 600 and img.size[1] > 100
        assert json.loads(img.text["rollmesh:rows"]) == list(pic.rows) == ["sa-0", "hy-0", TRAINER_ROW]


def test_proto_events_convert_to_the_same_dicts():
    from controller import convert
    from controller.core.events import EventLog, EventType

    log = EventLog(clock=lambda: 1234.5)
    e = log.append(EventType.STEP_PHASE, global_step=3, weight_version=2, replica_id="r",
                   replica_kind="REPLICA_KIND_HYBRID", attributes={"phase": "begin"})
    d = event_dict_from_proto(convert.event(e))
    assert d == _fields(e)


def test_event_details_keep_their_types_and_states_are_enums():
    from rollmesh.common.v1 import types_pb2
    from rollmesh.controller.v1 import scaling_pb2, scheduling_pb2

    from controller import convert
    from controller.core.events import EventLog, EventType, LifecycleEvent

    log = EventLog(clock=lambda: 10.0)
    sync = log.append(EventType.WEIGHT_SYNC_COMPLETED, weight_version=3,
                      attributes={"bytes_sent": 2**40, "duration_s": 0.25, "ok": True, "replica_ids": ["a", "b"],
                                  "skipped": None})
    msg = convert.event(sync)
    assert dict(msg.attributes) == {"bytes_sent": str(2**40), "duration_s": "0.25", "ok": "true",
                                    "replica_ids": "a,b"}
    assert msg.details["bytes_sent"] == 2**40 and msg.details["duration_s"] == 0.25 and msg.details["ok"] is True
    assert list(msg.details["replica_ids"]) == ["a", "b"] and "skipped" not in msg.details
    assert event_dict_from_proto(msg) == _fields(sync)
    assert msg.from_replica_state == msg.to_replica_state == types_pb2.REPLICA_STATE_UNSPECIFIED

    moved = log.append(EventType.REPLICA_STATE_CHANGED, replica_id="r", from_state="REPLICA_STATE_ACTIVE",
                       to_state="REPLICA_STATE_DRAINING")
    msg = convert.event(moved)
    assert (msg.from_replica_state, msg.to_replica_state) == (types_pb2.REPLICA_STATE_ACTIVE,
                                                             types_pb2.REPLICA_STATE_DRAINING)
    new = convert.event(log.append(EventType.REPLICA_STATE_CHANGED, replica_id="n", to_state="REPLICA_STATE_ACTIVE"))
    assert new.from_replica_state == types_pb2.REPLICA_STATE_UNSPECIFIED
    assert new.to_replica_state == types_pb2.REPLICA_STATE_ACTIVE
    op = convert.event(log.append(EventType.OPERATION_STATE_CHANGED, operation_id="o",
                                  from_state="OPERATION_STATE_PENDING", to_state="OPERATION_STATE_CREATING"))
    assert (op.from_operation_state, op.to_operation_state) == (scaling_pb2.OPERATION_STATE_PENDING,
                                                               scaling_pb2.OPERATION_STATE_CREATING)
    assert op.from_replica_state == types_pb2.REPLICA_STATE_UNSPECIFIED
    hybrid = convert.event(log.append(EventType.CONTROLLER_STATE_CHANGED, from_state="HYBRID_STATE_STANDALONE_ONLY",
                                      to_state="HYBRID_STATE_HYBRID_ACTIVE"))
    assert (hybrid.from_hybrid_state, hybrid.to_hybrid_state) == (scheduling_pb2.HYBRID_STATE_STANDALONE_ONLY,
                                                                  scheduling_pb2.HYBRID_STATE_HYBRID_ACTIVE)

    # an event saved before details existed comes back with its strings as its details
    saved = sync.to_document()
    saved.ClearField("details")
    assert LifecycleEvent.from_document(saved).details == sync.attributes


def _fields(event) -> dict:
    """A controller event's fields, its type by name: what the main job's events.jsonl holds."""
    return {**dataclasses.asdict(event), "type": event.type.value}
