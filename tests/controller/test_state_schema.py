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
from controller.core.events import EventLog, LifecycleEvent
from controller.core.replicas import ReplicaRegistry
from controller.state_schema import (
    EVENT,
    SCHEMA_VERSION,
    DocumentMismatch,
    DocumentSchema,
    NewerDocument,
    UnknownDocument,
)
from controller.store import StateStore
from mesh_runtime.config import load_config
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, observability_pb2, registry_pb2, scaling_pb2, scheduling_pb2
from tests.controller_core.conftest import AHEAD, LAGGING, build_mesh

pytestmark = pytest.mark.timeout(60)

BEFORE = json.loads((Path(__file__).parent / "data" / "store_before_schema.json").read_text())
"""A state store as the release before the schema wrote it (how: its ``written_by``)."""


def _progress(operation: operations_pb2.Operation) -> scaling_pb2.ScaleOperation:
    progress = scaling_pb2.ScaleOperation()
    assert operation.metadata.Unpack(progress)
    return progress


def _round_trip(schema: DocumentSchema, key: str, document: Message) -> Message:
    """``document`` stored and read back: equal to it, now stamped with the schema's version."""
    return schema.decode(key, schema.encode(key, document))


def test_every_document_of_a_store_written_before_the_schema_fits_its_message_and_is_written_the_same():
    """Read into its message and written again, each document of the release before the schema is the same JSON
    (plus its version): that release reads what this one writes, so a rollback finds its state."""
    schema = DocumentSchema()
    for key, document in [*BEFORE["documents"].items(), *((EVENT, event) for event in BEFORE["events"])]:
        message = schema.decode(key, json.dumps(document))   # version 0: read as it is
        assert message.schema_version == 0, key
        assert message == json_format.ParseDict(document, schema.message_of(key)()), key
        assert json.loads(schema.encode(key, message)) == {**document, "schema_version": 1}, key
        assert _round_trip(schema, key, message) == message, key


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
    scheduler = rewritten.load("scheduler", state_pb2.SchedulerDocument)
    assert scheduler is not None
    scheduler.ClearField("schema_version")   # 0 if untouched since, 1 if the scheduler wrote it back
    assert scheduler == json_format.ParseDict(BEFORE["documents"]["scheduler"], state_pb2.SchedulerDocument())


def test_a_document_of_a_newer_schema_is_refused_with_what_to_do(tmp_path):
    store = StateStore(str(tmp_path))
    assert store.backend is not None
    store.backend.write([("scheduler", json.dumps({"schema_version": 2, "current_step": 4}))], [], [])
    with pytest.raises(NewerDocument, match=r"'scheduler' has schema version 2, newer than this controller's 1"):
        store.load("scheduler", state_pb2.SchedulerDocument)


def test_a_document_its_message_does_not_describe_is_refused_and_nothing_is_written(tmp_path):
    store = StateStore(str(tmp_path))
    store.track("scheduler", lambda: state_pb2.MetricsDocument(next_cycle=4))   # a component wired wrong
    store.mark("scheduler")
    with pytest.raises(DocumentMismatch, match=r"'scheduler' must be a rollmesh.controller.state.v1.Scheduler"
                                               r"Document, not MetricsDocument"):
        store.flush()
    assert store.backend is not None and store.backend.load("scheduler") is None
    with pytest.raises(DocumentMismatch, match=r"'scheduler' is a SchedulerDocument, not a MetricsDocument"):
        store.load("scheduler", state_pb2.MetricsDocument)
    store.backend.write([("metrics", '{"next_cycle": "soon"}')], [], [])   # edited by hand
    with pytest.raises(DocumentMismatch, match=r"'metrics' is not a .*MetricsDocument.*starts '\{\"next_cycle\""):
        store.load("metrics", state_pb2.MetricsDocument)
    with pytest.raises(UnknownDocument, match="'checkpoints' has no message in the state schema"):
        store.track("checkpoints", state_pb2.MetricsDocument)


async def test_what_each_component_persists_is_its_message():
    """Documents of a run that went through every kind of step answer, from the components themselves: each
    is stored and read back unchanged, and a fresh component restored from it writes the same document."""
    schema = DocumentSchema()
    mesh = build_mesh()
    ctrl = mesh.controller()
    await ctrl.begin_step(1, StepReport(**LAGGING))
    await ctrl.complete_step(1, 1, StepReport(**LAGGING))   # activates the hybrids: a hybrid sync
    await ctrl.begin_step(2, StepReport(**LAGGING))
    await ctrl.release_hybrid(2, buffered_samples=40, waited_s=12.0, wait_expired=False)
    await ctrl.complete_step(2, 2, StepReport(**AHEAD, step_wait_times=[0.5], step_wait_samples=[3]))
    saved = ctrl.to_document()
    assert all(saved.HasField(name) for name in ("begin", "release", "complete", "policy"))
    assert saved.complete.standalone_sync.replica_results and saved.policy.fields
    stored = _round_trip(schema, "scheduler", saved)
    assert stored == saved
    fresh = build_mesh().controller()
    fresh.restore(stored)
    assert _stamped(fresh.to_document()) == stored

    documents = [document for _, document in mesh.registry.take_changes()]
    assert documents and all(d is not None and _round_trip(schema, "registry/node/x", d) == d for d in documents)
    restored = ReplicaRegistry.from_documents(documents, clock=mesh.clock, lease_ttl_s=30)

    def records(registry: ReplicaRegistry) -> list[state_pb2.Replica]:
        documents = [r.to_document() for r in registry.replicas()]
        for document in documents:
            document.ClearField("lease_expires_at")
        return documents

    assert records(restored) == records(mesh.registry)   # each lease starts afresh

    metrics = _round_trip(schema, "metrics", mesh.metrics.to_document())
    assert metrics.closed and metrics == _stamped(mesh.metrics.to_document())
    again = build_mesh().metrics
    again.restore(metrics)
    assert _stamped(again.to_document()) == metrics

    events = mesh.events.since(0)[0]
    assert events and all(LifecycleEvent.from_document(_round_trip(schema, EVENT, e.to_document())) == e
                          for e in events)
    log = EventLog(mesh.clock)
    log.restore(_round_trip(schema, "events", mesh.events.to_document()), [e.to_document() for e in events])
    assert log.last_sequence == mesh.events.last_sequence

    book = OperationBook(clock=lambda: 5.0, emit=lambda *args, **kwargs: None)
    op = book.new(OperationType.SCALE_OUT, num_replicas=3)
    book.transition(op, OperationState.CREATING, "launching")
    operations = _round_trip(schema, "operations", book.to_document())
    assert operations == _stamped(book.to_document())
    copy = OperationBook(clock=lambda: 5.0, emit=lambda *args, **kwargs: None)
    copy.restore(operations)
    assert copy.list() == book.list()
    entry = history_entry(op, Decision("scale_out", 1, "queue above threshold", ("queue_high",),
                                       {"time": 5.0, "num_engines": 2, "avg_token_usage": 0.93}), 5.0)
    autoscaler = state_pb2.AutoscalerDocument(enabled=True, history=[entry], last_scale_action="scale_out",
                                              last_scale_time=5.0)
    assert _round_trip(schema, "autoscaler", autoscaler) == autoscaler


def _stamped(document: Message) -> Message:
    document.schema_version = SCHEMA_VERSION  # type: ignore[attr-defined]
    return document
