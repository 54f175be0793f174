"""Scale RPCs of an in-process controller: bad input, NOOP, dry runs, protection, conflict, credentials.

Nodes are registered by RPC with the replicas an agent would report; no agent
runs, so every case here must be decided before any agent is called (dry
runs, refusals, NOOPs) - which is also what makes "nothing changed" checkable.
"""

from __future__ import annotations

import grpc
import pytest
from google.longrunning import operations_pb2
from google.rpc import error_details_pb2

from controller.server import SPEC
from mesh_runtime.config import load_config
from mesh_runtime.errors import error_info
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import autoscaler_pb2, controller_pb2, registry_pb2, scaling_pb2
from tests.controller.scaling.helpers import (
    TERMINAL, controller_stub, get_op, list_ops, name, progress, scale_in, scale_in_request, scale_out,
    scale_out_request)

pytestmark = pytest.mark.timeout(60)
TOKEN = "s3cret-scale"
READ = "viewer-token"


async def start(tmp_path, **overrides):
    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0",
                                                             "state_dir": str(tmp_path / "state"), **overrides})
    server, port = await SPEC.create(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, controller_stub(channel)


async def register(stub, node: str, slots: int, replicas: list[tuple[str, bool]]):
    await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
        node_id=node, address=f"127.0.0.1:{40000 + len(node)}", slots_total=slots, replicas=[
            registry_pb2.ReplicaRegistration(replica_id=r, kind=types_pb2.REPLICA_KIND_STANDALONE,
                                             state=types_pb2.REPLICA_STATE_ACTIVE, initial=initial, slots=[i])
            for i, (r, initial) in enumerate(replicas)]))


async def expect(call, code, fragment, reason=None):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details(), info.value.details()
    detail = error_info(info.value)
    assert detail.domain == "rollmesh"
    if reason:
        assert detail.reason == reason
    return info.value


async def test_bad_input_is_refused_with_a_clear_status_and_changes_nothing(tmp_path):
    server, channel, stub = await start(tmp_path)
    try:
        await register(stub, "n", 4, [("n-0", True), ("n-1", False)])
        out, in_ = scale_out_request, scale_in_request
        bad_out = [
            (out(num_replicas=-1), "num_replicas must be at least 1"),
            (out(num_replicas=0), "num_replicas must be at least 1"),
            (out(num_replicas=100000), "max_replicas_per_model"),
            (out(), "give num_replicas"),
            (scaling_pb2.ScaleOutRequest(external=scaling_pb2.EngineAddresses()), "external.addresses is required"),
            (out(engine_addresses=["not-an-address"]), "not HOST:PORT"),
            (out(engine_addresses=["127.0.0.1:0"]), "not HOST:PORT"),
            (out(engine_addresses=["127.0.0.1:5", "127.0.0.1:5"]), "repeats"),
            (out(num_replicas=3, timeout={"seconds": -5}), "timeout must be positive"),
            (out(num_replicas=3, partial_success_policy=9), "partial_success_policy"),
        ]
        for request, fragment in bad_out:
            await expect(stub.ScaleOut(request), grpc.StatusCode.INVALID_ARGUMENT, fragment)
        # the oneof keeps the last target set: both cannot be sent
        both = out(engine_addresses=["127.0.0.1:1"])
        both.num_replicas = 3
        assert both.WhichOneof("target") == "num_replicas" and not both.HasField("external")
        bad_in = [
            (in_(num_replicas=-2), "num_replicas must be at least 1"),
            (in_(), "give num_replicas"),
            (scaling_pb2.ScaleInRequest(replicas=scaling_pb2.ReplicaSelection()), "at least one replica"),
            (in_(engine_addresses=["::nope"]), "not HOST:PORT"),
            (in_(replica_ids=["a", "a"]), "distinct"),
        ]
        for request, fragment in bad_in:
            await expect(stub.ScaleIn(request), grpc.StatusCode.INVALID_ARGUMENT, fragment)
        await expect(stub.ScaleIn(in_(replica_ids=["ghost"])), grpc.StatusCode.NOT_FOUND, "ghost")
        await expect(stub.ScaleIn(in_(engine_addresses=["127.0.0.1:9"])),
                     grpc.StatusCode.NOT_FOUND, "127.0.0.1:9", "ADDRESS_NOT_FOUND")
        await expect(stub.ops.GetOperation(operations_pb2.GetOperationRequest(name="operations/nope")),
                     grpc.StatusCode.NOT_FOUND, "nope", "OPERATION_NOT_FOUND")
        for name in ("", "nope", "operations/", "operations/a/b", "projects/p/operations/x"):
            await expect(stub.ops.GetOperation(operations_pb2.GetOperationRequest(name=name)),
                         grpc.StatusCode.INVALID_ARGUMENT, "operations/{operation_id}", "INVALID_OPERATION_NAME")
        await expect(stub.ops.CancelOperation(operations_pb2.CancelOperationRequest(name="operations/nope")),
                     grpc.StatusCode.NOT_FOUND, "nope")
        await expect(stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name="operations/nope")),
                     grpc.StatusCode.NOT_FOUND, "nope")
        await expect(stub.ops.ListOperations(operations_pb2.ListOperationsRequest(name="projects/x")),
                     grpc.StatusCode.INVALID_ARGUMENT, "projects/x", "INVALID_OPERATION_NAME")
        for bad_filter, fragment in [("state = ACTIV", "unknown state 'ACTIV'"), ("colour = red", "unknown field"),
                                     ("state ACTIVE", "cannot read"), ("type = (SCALE_OUT OR )", "empty value"),
                                     ("x" * 2000, "at most 1000")]:
            await expect(stub.ops.ListOperations(operations_pb2.ListOperationsRequest(filter=bad_filter)),
                         grpc.StatusCode.INVALID_ARGUMENT, fragment, "INVALID_FILTER")
        await expect(stub.CancelOperations(scaling_pb2.CancelOperationsRequest(
            states=[scaling_pb2.OPERATION_STATE_ACTIVE])), grpc.StatusCode.INVALID_ARGUMENT, "finished states")
        await expect(stub.ScaleOut(out(num_replicas=9)), grpc.StatusCode.FAILED_PRECONDITION,
                     "free slots", "NO_FREE_SLOTS")
        assert await list_ops(stub) == []
        replicas = (await stub.ListReplicas(registry_pb2.ListReplicasRequest())).replicas
        assert sorted(r.replica_id for r in replicas) == ["n-0", "n-1"]
    finally:
        await channel.close()
        await server.stop(0)


async def test_noop_dry_runs_protection_and_lifo_preview(tmp_path):
    server, channel, stub = await start(tmp_path)
    try:
        await register(stub, "n", 6, [("n-0", True), ("n-1", True), ("n-2", False), ("n-3", False)])
        reply = await stub.ScaleOut(scale_out_request(num_replicas=4))
        noop = progress(reply)
        assert noop.state == scaling_pb2.OPERATION_STATE_NOOP and noop.model_name == "default"
        assert reply.done and reply.name == f"operations/{noop.operation_id}" and not reply.HasField("error")
        result = scaling_pb2.ScaleResult()
        assert reply.response.Unpack(result) and result.state == scaling_pb2.OPERATION_STATE_NOOP
        assert (await get_op(stub, noop.operation_id)).state == scaling_pb2.OPERATION_STATE_NOOP
        await expect(stub.ops.CancelOperation(operations_pb2.CancelOperationRequest(
            name=f"operations/{noop.operation_id}")), grpc.StatusCode.FAILED_PRECONDITION, "NOOP",
            "OPERATION_NOT_CANCELLABLE")

        reply = await stub.ScaleOut(scale_out_request(num_replicas=6, dry_run=True))
        preview = progress(reply)
        assert preview.dry_run and preview.state == scaling_pb2.OPERATION_STATE_PENDING
        assert reply.done and reply.name == ""   # a preview is not stored: nothing to read back
        await expect(stub.ops.GetOperation(operations_pb2.GetOperationRequest(
            name=f"operations/{preview.operation_id}")), grpc.StatusCode.NOT_FOUND, preview.operation_id)

        reply = await stub.ScaleIn(scale_in_request(num_replicas=3, dry_run=True))
        assert list(progress(reply).would_remove_replica_ids) == ["n-3"]  # the newest non-initial replica
        assert reply.response.Unpack(result) and list(result.replica_ids) == ["n-3"]
        await expect(stub.ScaleIn(scale_in_request(num_replicas=1)), grpc.StatusCode.FAILED_PRECONDITION,
                     "protected", "PROTECTED_REPLICA")
        await expect(stub.ScaleIn(scale_in_request(replica_ids=["n-0"])),
                     grpc.StatusCode.FAILED_PRECONDITION, "initial", "PROTECTED_REPLICA")
        noop_in = await scale_in(stub, num_replicas=5)
        assert noop_in.state == scaling_pb2.OPERATION_STATE_NOOP
        assert [o.operation_id for o in await list_ops(stub, "type = SCALE_IN")] == [noop_in.operation_id]
        assert [o.operation_id for o in await list_ops(stub, 'state = (NOOP OR FAILED) AND model_name = "default"')
                ] == [noop_in.operation_id, noop.operation_id]
        assert await list_ops(stub, "model_name = other") == []
        assert [o.operation_id for o in await list_ops(stub, "type = OPERATION_TYPE_SCALE_OUT AND state = NOOP")
                ] == [noop.operation_id]
        # DeleteOperation forgets a finished operation
        await stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name=f"operations/{noop.operation_id}"))
        assert [o.operation_id for o in await list_ops(stub)] == [noop_in.operation_id]
        replicas = (await stub.ListReplicas(registry_pb2.ListReplicasRequest())).replicas
        assert all(r.state == types_pb2.REPLICA_STATE_ACTIVE for r in replicas) and len(replicas) == 4
        status = await stub.GetStatus(controller_pb2.GetStatusRequest())
        assert status.running_operation_id == "" and "scaling" in status.status.capabilities
    finally:
        await channel.close()
        await server.stop(0)


async def test_mutating_scale_rpcs_need_the_credential(tmp_path):
    server, channel, stub = await start(tmp_path, scale_api_token=TOKEN, scale_api_read_tokens=[READ])
    try:
        await register(stub, "n", 2, [("n-0", True), ("n-1", False)])
        request = scale_in_request(num_replicas=1, dry_run=True)
        await expect(stub.ScaleIn(request), grpc.StatusCode.UNAUTHENTICATED, "Bearer", "CREDENTIAL_MISSING")
        await expect(stub.ScaleIn(request, metadata=[("authorization", "Bearer wrong")]),
                     grpc.StatusCode.UNAUTHENTICATED, "not valid", "INVALID_CREDENTIAL")
        await expect(stub.ScaleIn(request, metadata=[("authorization", "Basic abc")]),
                     grpc.StatusCode.UNAUTHENTICATED, "Bearer", "MALFORMED_CREDENTIAL")
        await expect(stub.ScaleOut(scale_out_request(num_replicas=5),
                                   metadata=[("authorization", f"Bearer {READ}")]),
                     grpc.StatusCode.PERMISSION_DENIED, "read-only", "READ_ONLY_CREDENTIAL")
        await expect(stub.CancelOperations(scaling_pb2.CancelOperationsRequest(dry_run=True)),
                     grpc.StatusCode.UNAUTHENTICATED, "Bearer")
        for call in (stub.ops.CancelOperation(operations_pb2.CancelOperationRequest(name="operations/x")),
                     stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name="operations/x")),
                     stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name="bad name"))):
            await expect(call, grpc.StatusCode.UNAUTHENTICATED, "Bearer")   # the credential before the name
        await expect(stub.SetAutoscalerEnabled(autoscaler_pb2.SetAutoscalerEnabledRequest(enabled=True),
                                               metadata=[("authorization", f"Bearer {READ}")]),
                     grpc.StatusCode.PERMISSION_DENIED, "read-only")
        assert await list_ops(stub) == []  # reads need none
        reply = await stub.ScaleIn(scale_in_request(num_replicas=1, dry_run=True),
                                   metadata=[("authorization", f"Bearer {TOKEN}")])
        assert list(progress(reply).would_remove_replica_ids) == ["n-1"]
    finally:
        await channel.close()
        await server.stop(0)


async def test_autoscaler_rpcs_without_a_config(tmp_path):
    server, channel, stub = await start(tmp_path)
    try:
        status = (await stub.GetAutoscalerStatus(autoscaler_pb2.GetAutoscalerStatusRequest())).status
        assert not status.configured and not status.enabled and not status.running
        await expect(stub.SetAutoscalerEnabled(autoscaler_pb2.SetAutoscalerEnabledRequest(enabled=True)),
                     grpc.StatusCode.FAILED_PRECONDITION, "autoscaler_config", "AUTOSCALER_NOT_CONFIGURED")
        await expect(stub.GetAutoscalerConditions(autoscaler_pb2.GetAutoscalerConditionsRequest()),
                     grpc.StatusCode.FAILED_PRECONDITION, "autoscaler")
        history = await stub.ListScaleHistory(autoscaler_pb2.ListScaleHistoryRequest())
        assert list(history.history) == [] and history.total_count == 0
    finally:
        await channel.close()
        await server.stop(0)


async def test_autoscaler_rpcs_with_a_config(tmp_path):
    path = tmp_path / "autoscaler.yaml"
    path.write_text("min_engines: 2\nmax_engines: 8\nscale_out_policy: {token_usage_threshold: 0.8}\n")
    server, channel, stub = await start(tmp_path, autoscaler_config=str(path))
    try:
        status = (await stub.GetAutoscalerStatus(autoscaler_pb2.GetAutoscalerStatusRequest())).status
        assert status.configured and status.enabled and status.running
        assert (status.min_engines, status.max_engines) == (2, 8)
        status = (await stub.SetAutoscalerEnabled(autoscaler_pb2.SetAutoscalerEnabledRequest(enabled=False))).status
        assert not status.enabled
        conditions = (await stub.GetAutoscalerConditions(autoscaler_pb2.GetAutoscalerConditionsRequest())).conditions
        by_name = {c.name: c for c in conditions}
        assert set(by_name) == {"token_usage_high", "queue_backlog", "queue_latency_high", "ttft_high",
                                "token_usage_low", "no_queue", "throughput_stable"}
        assert by_name["token_usage_high"].threshold == pytest.approx(0.8)
        assert by_name["token_usage_high"].required_for.seconds == 30
        assert by_name["no_queue"].type == autoscaler_pb2.SCALE_ACTION_SCALE_IN
        assert not any(c.triggered for c in conditions)
    finally:
        await channel.close()
        await server.stop(0)
    # disabled is durable
    server, channel, stub = await start(tmp_path, autoscaler_config=str(path))
    try:
        status = (await stub.GetAutoscalerStatus(autoscaler_pb2.GetAutoscalerStatusRequest())).status
        assert status.configured and not status.enabled
    finally:
        await channel.close()
        await server.stop(0)


def test_a_bad_autoscaler_config_is_refused_at_startup(tmp_path):
    from mesh_runtime.config import ConfigError

    path = tmp_path / "autoscaler.yaml"
    path.write_text("min_engines: 9\nmax_engines: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(SPEC.config_class, None, overrides={"autoscaler_config": str(path)})
    assert "autoscaler_config" in str(info.value) and "min_engines" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(SPEC.config_class, None, overrides={"autoscaler_config": str(tmp_path / "missing.yaml")})
    assert "cannot read" in str(info.value)


async def test_a_native_launch_that_fails_is_rolled_back(tmp_path):
    import socket

    from rollmesh.controller.v1 import events_pb2
    from rollmesh.controller.v1 import observability_pb2
    from tests.controller.scaling.helpers import finished

    with socket.socket() as sock:  # a port nothing listens on: the "agent" refuses every call
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    server, channel, stub = await start(tmp_path, async_training={"port_timeout_s": 5})
    try:
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="gone", address=dead, slots_total=3))
        op = await scale_out(stub, num_replicas=2)
        op = await finished(stub, op.operation_id, timeout_s=30)
        assert op.state == scaling_pb2.OPERATION_STATE_FAILED and "UNAVAILABLE" in op.error_message
        failed = await stub.ops.GetOperation(operations_pb2.GetOperationRequest(name=name(op.operation_id)))
        assert failed.done and failed.error.code == grpc.StatusCode.ABORTED.value[0]
        assert failed.error.message == op.error_message and not failed.HasField("response")
        info = error_details_pb2.ErrorInfo()
        assert failed.error.details[0].Unpack(info) and info.reason == "SCALE_OPERATION_FAILED"
        assert info.metadata["operation_id"] == op.operation_id
        assert sorted(op.failed_replica_ids) == sorted(op.replica_ids) and len(op.replica_ids) == 2
        states = [c.state for c in op.state_history]
        assert states == [scaling_pb2.OPERATION_STATE_PENDING, scaling_pb2.OPERATION_STATE_CREATING,
                          scaling_pb2.OPERATION_STATE_FAILED]
        records = {r.replica_id: r for r in (await stub.ListReplicas(registry_pb2.ListReplicasRequest())).replicas}
        assert all(records[r].state == types_pb2.REPLICA_STATE_REMOVED and records[r].intentionally_removed
                   for r in op.replica_ids)
        call = stub.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True))
        seen = []
        async for message in call:
            if message.event.type == events_pb2.EVENT_TYPE_OPERATION_STATE_CHANGED:
                seen.append(message.event.to_state)
            if message.event.to_state == "OPERATION_STATE_FAILED":
                break
        call.cancel()
        assert seen == ["OPERATION_STATE_PENDING", "OPERATION_STATE_CREATING", "OPERATION_STATE_FAILED"]
        # Nothing is left counting toward the target: the same request now fails the same way, not NOOP.
        again = await scale_out(stub, num_replicas=2)
        assert again.state == scaling_pb2.OPERATION_STATE_PENDING
        await finished(stub, again.operation_id, timeout_s=30)
    finally:
        await channel.close()
        await server.stop(0)


async def test_no_free_slots_stays_small_on_a_500_node_fleet(tmp_path):
    server, channel, stub = await start(tmp_path, max_replicas_per_model=1000, lease_ttl_s=600)
    try:
        for n in range(500):
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id=f"node-{n:03d}", address=f"127.0.0.1:{20000 + n}", slots_total=1, replicas=[
                    registry_pb2.ReplicaRegistration(replica_id=f"r-{n:03d}", kind=types_pb2.REPLICA_KIND_STANDALONE,
                                                     state=types_pb2.REPLICA_STATE_ACTIVE, initial=True, slots=[0])]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ScaleOut(scale_out_request(num_replicas=501, dry_run=True))
        info = error_info(err.value)
        assert info.reason == "NO_FREE_SLOTS" and info.metadata["nodes"] == "500"
        assert len(err.value.details()) < 400 and "0 on 500 node(s)" in err.value.details()
        assert "and 495 more node(s)" in err.value.details()
        assert sum(len(k) + len(v) for k, v in err.value.trailing_metadata()) < 2000
    finally:
        await channel.close()
        await server.stop(0)


async def test_operations_are_listed_in_pages_newest_first(tmp_path):
    server, channel, stub = await start(tmp_path)
    try:
        await register(stub, "n", 6, [("n-0", True), ("n-1", True), ("n-2", False), ("n-3", False)])
        made = [(await scale_out(stub, num_replicas=4)).operation_id for _ in range(5)]   # NOOPs: 4 serve
        everything = [o.operation_id for o in await list_ops(stub)]
        assert sorted(everything) == sorted(made) and everything[0] == made[-1]   # newest first
        seen, token, pages = [], "", 0
        while True:
            reply = await stub.ops.ListOperations(operations_pb2.ListOperationsRequest(page_size=2, page_token=token))
            seen += [progress(o).operation_id for o in reply.operations]
            pages, token = pages + 1, reply.next_page_token
            if not token:
                break
        assert seen == everything and pages == 3
        first = await stub.ops.ListOperations(operations_pb2.ListOperationsRequest(page_size=2))
        await expect(stub.ops.ListOperations(operations_pb2.ListOperationsRequest(
            page_size=2, page_token=first.next_page_token, filter="type = SCALE_IN")),
            grpc.StatusCode.INVALID_ARGUMENT, "other filters", "INVALID_PAGE_TOKEN")
        await expect(stub.ops.ListOperations(operations_pb2.ListOperationsRequest(page_size=-1)),
                     grpc.StatusCode.INVALID_ARGUMENT, "page_size", "INVALID_PAGE_SIZE")
    finally:
        await channel.close()
        await server.stop(0)


async def test_wait_operation_returns_when_the_operation_ends_or_the_wait_does(tmp_path):
    import asyncio
    import socket

    from google.protobuf import duration_pb2

    # an "agent" that accepts connections and never answers: the launch hangs until port_timeout_s
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    server, channel, stub = await start(tmp_path, async_training={"port_timeout_s": 2})
    try:
        await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
            node_id="mute", address=f"127.0.0.1:{silent.getsockname()[1]}", slots_total=2))
        op = await scale_out(stub, num_replicas=1, timeout=duration_pb2.Duration(seconds=6))

        def wait(operation_id: str = op.operation_id, **fields):
            return operations_pb2.WaitOperationRequest(name=name(operation_id), **fields)

        short = await stub.ops.WaitOperation(wait(timeout=duration_pb2.Duration(nanos=300_000_000)), timeout=10)
        assert not short.done and progress(short).state not in TERMINAL, short
        # no timeout of its own: the call's deadline bounds it, and the answer comes before that deadline
        bounded = await stub.ops.WaitOperation(wait(), timeout=1.0)
        assert not bounded.done
        started = asyncio.get_running_loop().time()
        ended = await stub.ops.WaitOperation(wait(), timeout=60)
        # answered when the launch failed (the operation's 6 s timeout), not near the call's 60 s deadline
        assert asyncio.get_running_loop().time() - started < 45
        assert ended.done and progress(ended).state == scaling_pb2.OPERATION_STATE_FAILED
        assert ended == await stub.ops.GetOperation(operations_pb2.GetOperationRequest(name=name(op.operation_id)))
        again = await stub.ops.WaitOperation(wait(), timeout=5)   # finished: at once
        assert again.done and again == ended

        await expect(stub.ops.WaitOperation(wait(timeout=duration_pb2.Duration(seconds=-1))),
                     grpc.StatusCode.INVALID_ARGUMENT, "timeout must be positive", "INVALID_TIMEOUT")
        await expect(stub.ops.WaitOperation(wait("nope")), grpc.StatusCode.NOT_FOUND, "nope", "OPERATION_NOT_FOUND")
        await expect(stub.ops.WaitOperation(operations_pb2.WaitOperationRequest()), grpc.StatusCode.INVALID_ARGUMENT,
                     "operations/{operation_id}", "INVALID_OPERATION_NAME")
        # a finished operation can be deleted; a running one cannot
        running = await scale_out(stub, num_replicas=1, timeout=duration_pb2.Duration(seconds=6))
        await expect(stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name=name(running.operation_id))),
                     grpc.StatusCode.FAILED_PRECONDITION, "only a finished operation", "OPERATION_NOT_FINISHED")
        await stub.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=name(running.operation_id)))
        cancelled = await stub.ops.GetOperation(operations_pb2.GetOperationRequest(name=name(running.operation_id)))
        assert cancelled.done and cancelled.error.code == grpc.StatusCode.CANCELLED.value[0]
        assert progress(cancelled).state == scaling_pb2.OPERATION_STATE_CANCELLED
        await stub.ops.DeleteOperation(operations_pb2.DeleteOperationRequest(name=name(op.operation_id)))
        assert [o.operation_id for o in await list_ops(stub)] == [running.operation_id]
    finally:
        await channel.close()
        await server.stop(0)
        silent.close()
