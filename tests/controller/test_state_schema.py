"""The durable state's schema (proto/rollmesh/controller/state/v1): every document the controller writes is a
message of it, a store written before the schema is read unchanged, and what does not fit is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from controller.core.steps import StepReport
from controller.scaling.autoscaler import Decision
from controller.scaling.autoscaler_loop import history_entry
from controller.scaling.operations import OperationBook, OperationState, OperationType
from controller.server import SPEC
from controller.state_schema import EVENT, DocumentMismatch, DocumentSchema, NewerDocument, UnknownDocument
from controller.store import StateStore
from mesh_runtime.config import load_config
from google.longrunning import operations_pb2, operations_pb2_grpc
from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, registry_pb2, scaling_pb2, scheduling_pb2
from tests.controller_core.conftest import AHEAD, LAGGING, build_mesh

pytestmark = pytest.mark.timeout(60)

BEFORE = json.loads((Path(__file__).parent / "data" / "store_before_schema.json").read_text())
"""A state store as the release before the schema wrote it (how: its ``written_by``)."""


def _progress(operation: operations_pb2.Operation) -> scaling_pb2.ScaleOperation:
    progress = scaling_pb2.ScaleOperation()
    assert operation.metadata.Unpack(progress)
    return progress


def _round_trip(schema: DocumentSchema, key: str, document: dict) -> dict:
    text = schema.encode(key, document)
    schema.check(key, text)
    return schema.decode(key, text)


def test_every_document_of_a_store_written_before_the_schema_fits_its_message():
    schema = DocumentSchema()
    for key, document in BEFORE["documents"].items():
        assert schema.decode(key, json.dumps(document)) == document, key   # version 0: read as it is
        assert _round_trip(schema, key, document) == document, key
    for event in BEFORE["events"]:
        assert schema.decode(EVENT, json.dumps(event)) == event


async def test_a_controller_resumes_from_a_store_written_before_the_schema(tmp_path):
    state = tmp_path / "state"
    old = StateStore(str(state))
    assert old.backend is not None
    old.backend.write([(key, json.dumps(doc)) for key, doc in BEFORE["documents"].items()], [],
                      [(event["sequence"], json.dumps(event)) for event in BEFORE["events"]])
    old.close()
    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0", "state_dir": str(state)})
    server, port = await SPEC.create(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            nodes = (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes
            assert sorted(n.node_id for n in nodes) == ["a", "trainer-0"]
            scheduler = await stub.GetSchedulerState(scheduling_pb2.GetSchedulerStateRequest())
            assert scheduler.last_global_step == 3
            assert scheduler.next_call == scheduling_pb2.STEP_CALL_BEGIN_TRAINING_STEP
            listed = await operations_pb2_grpc.OperationsStub(channel).ListOperations(
                operations_pb2.ListOperationsRequest())
            states = sorted(_progress(op).state for op in listed.operations)
            assert states == [scaling_pb2.OPERATION_STATE_ACTIVE, scaling_pb2.OPERATION_STATE_COMPLETED]
            last = BEFORE["events"][-1]["sequence"]
            sequences = []
            async for reply in stub.WatchEvents(observability_pb2.WatchEventsRequest(from_sequence=1,
                                                                                     include_history=True)):
                sequences.append(reply.event.sequence)
                if reply.event.sequence > last:   # the restart's own event: numbering goes on after the restored
                    break
            assert sequences == [e["sequence"] for e in BEFORE["events"]] + [last + 1]
    finally:
        await server.stop(0)
    rewritten = StateStore(str(state))
    assert rewritten.backend is not None
    newest = json.loads(rewritten.backend.load_events(1)[0])
    assert newest["schema_version"] == 1 and newest["type"] == "CONTROLLER_STATE_CHANGED"   # what it wrote: version 1
    assert rewritten.load("scheduler") == BEFORE["documents"]["scheduler"]


def test_a_document_of_a_newer_schema_is_refused_with_what_to_do(tmp_path):
    store = StateStore(str(tmp_path))
    assert store.backend is not None
    store.backend.write([("scheduler", json.dumps({"schema_version": 2, "current_step": 4}))], [], [])
    with pytest.raises(NewerDocument, match=r"'scheduler' has schema version 2, newer than this controller's 1"):
        store.load("scheduler")


def test_a_document_its_message_does_not_describe_is_refused_and_nothing_is_written(tmp_path):
    store = StateStore(str(tmp_path))
    store.track("scheduler", lambda: {"current_stepp": 4})   # a component that drifted from the schema
    store.mark("scheduler")
    with pytest.raises(DocumentMismatch, match=r"'scheduler' is not a rollmesh.controller.state.v1.Scheduler"
                                               r"Document: .*current_stepp"):
        store.flush()
    assert store.backend is not None and store.backend.load("scheduler") is None
    store.backend.write([("metrics", '{"next_cycle": "soon"}')], [], [])   # edited by hand
    with pytest.raises(DocumentMismatch, match=r"'metrics' is not a .*MetricsDocument.*starts '\{\"next_cycle\""):
        store.load("metrics")
    with pytest.raises(UnknownDocument, match="'checkpoints' has no message in the state schema"):
        store.track("checkpoints", dict)


async def test_what_each_component_persists_is_its_message():
    """Documents of a run that went through every kind of step answer, from the components themselves."""
    schema = DocumentSchema()
    mesh = build_mesh()
    ctrl = mesh.controller()
    await ctrl.begin_step(1, StepReport(**LAGGING))
    await ctrl.complete_step(1, 1, StepReport(**LAGGING))   # activates the hybrids: a hybrid sync
    await ctrl.begin_step(2, StepReport(**LAGGING))
    await ctrl.release_hybrid(2, buffered_samples=40, waited_s=12.0, wait_expired=False)
    await ctrl.complete_step(2, 2, StepReport(**AHEAD, step_wait_times=[0.5], step_wait_samples=[3]))
    saved = ctrl.state_dict()
    assert saved["begin"] and saved["release"] and saved["complete"] and saved["policy"]
    assert _round_trip(schema, "scheduler", saved) == saved
    for node_id, document in mesh.registry.take_changes():
        assert document is not None and _round_trip(schema, f"registry/node/{node_id}", document) == document
    assert _round_trip(schema, "metrics", mesh.metrics.state_dict()) == mesh.metrics.state_dict()
    events = [event.to_dict() for event in mesh.events.since(0)[0]]
    assert events and all(_round_trip(schema, EVENT, event) == event for event in events)

    book = OperationBook(clock=lambda: 5.0, emit=lambda *args, **kwargs: None)
    op = book.new(OperationType.SCALE_OUT, num_replicas=3)
    book.transition(op, OperationState.CREATING, "launching")
    assert _round_trip(schema, "operations", book.to_dict()) == book.to_dict()
    entry = history_entry(op, Decision("scale_out", 1, "queue above threshold", ("queue_high",),
                                       {"time": 5.0, "num_engines": 2, "avg_token_usage": 0.93}), 5.0)
    autoscaler = {"enabled": True, "history": [entry], "last_scale_action": "scale_out", "last_scale_time": 5.0}
    assert _round_trip(schema, "autoscaler", autoscaler) == autoscaler
