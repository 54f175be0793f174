"""The controller in-process (grpc.aio on port 0): bad input, event fan-out, restart of the step protocol."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from controller.core.events import EventLog, EventType
from controller.server import SPEC
from controller.watchers import EventHub
from mesh_runtime.config import load_config
from mesh_runtime.errors import error_info
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2, scheduling_pb2, weight_sync_pb2
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(60)


async def start(tmp_path, **overrides):
    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0",
                                                             "state_dir": str(tmp_path / "state"), **overrides})
    server, port = await SPEC.create(config)
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def test_bad_input_gets_clear_statuses_and_changes_nothing(tmp_path):
    server, channel = await start(tmp_path)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        cases = [
            (stub.GetReplica(registry_pb2.GetReplicaRequest(replica_id="ghost")), grpc.StatusCode.NOT_FOUND, "ghost"),
            (stub.GetNode(registry_pb2.GetNodeRequest(node_id="nowhere")), grpc.StatusCode.NOT_FOUND, "nowhere"),
            (stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="", address="127.0.0.1:1", slots_total=1)),
             grpc.StatusCode.INVALID_ARGUMENT, "node_id"),
            (stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="n", address="127.0.0.1:1", slots_total=0)),
             grpc.StatusCode.INVALID_ARGUMENT, "slots_total"),
            (stub.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(global_step=1, weight_version=1)),
             grpc.StatusCode.FAILED_PRECONDITION, "BeginTrainingStep"),
            (stub.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=-1)),
             grpc.StatusCode.INVALID_ARGUMENT, "weight_version"),
            (stub.SyncWeights(weight_sync_pb2.SyncWeightsRequest(timeout=Duration(seconds=-2))),
             grpc.StatusCode.INVALID_ARGUMENT, "timeout must be positive"),
            (stub.SyncWeights(weight_sync_pb2.SyncWeightsRequest(replica_ids=["ghost"])),
             grpc.StatusCode.NOT_FOUND, "ghost"),
            (stub.SyncWeights(weight_sync_pb2.SyncWeightsRequest(source_address="trainer-0" + "x" * 300)),
             grpc.StatusCode.INVALID_ARGUMENT, "source_address must be HOST:PORT, got 'trainer-0xxx"),
        ]
        for call, code, fragment in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == code, info.value.details()
            assert fragment in info.value.details()
            assert error_info(info.value).domain == "rollmesh"
        assert (await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes == []
    finally:
        await channel.close()
        await server.stop(0)


async def test_step_protocol_position_survives_a_restart(tmp_path):
    server, channel = await start(tmp_path)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    begin = await stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(
        global_step=7, report=scheduling_pb2.StepReport()))
    await channel.close()
    await server.stop(0)
    server, channel = await start(tmp_path)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        state = await stub.GetSchedulerState(scheduling_pb2.GetSchedulerStateRequest())
        assert state.last_global_step == 7
        assert state.next_call == scheduling_pb2.STEP_CALL_COMPLETE_TRAINING_STEP
        again = await stub.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(
            global_step=7, report=scheduling_pb2.StepReport()))
        assert again == begin  # the recorded answer, not a second decision
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_slow_watcher_never_blocks_and_is_told_what_it_missed():
    log = EventLog(lambda: 0.0, max_events=5)
    hub = EventHub(log, queue_size=2)
    stream = hub.watch(0, lambda e: True, include_history=False)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the watcher is registered and waiting
    for i in range(12):  # overflows the watcher's queue and the log's retention; never blocks
        hub.stored(log.append(EventType.STEP_PHASE, reason=f"e{i}").sequence)
    received = [await first] + [await stream.__anext__() for _ in range(5)]
    await stream.aclose()
    gap = received[0]  # its queue overflowed and the log kept only the newest 5
    assert gap.type is EventType.GAP and gap.missed_events == 7
    assert [e.reason for e in received[1:]] == ["e7", "e8", "e9", "e10", "e11"]


def test_an_unknown_policy_is_rejected_at_startup():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "launcher.cli", "controller", "--listen", "127.0.0.1:0"],
                            env=clean_env(ROLLMESH_CONTROLLER__ASYNC_TRAINING__DYNAMIC_SCHEDULE_POLICY="nope:Missing"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "async_training.dynamic_schedule_policy" in result.stderr and len(result.stderr.strip().splitlines()) == 1
