"""A real mesh for the scaling tests: balancer, controller and replica agents as processes, plus probes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc

from rollmesh.common.v1 import generation_pb2

from rollmesh.controller.v1 import events_pb2
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, observability_pb2, registry_pb2, scaling_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc
from tests.processes import running_server
from tests.waiting import wait_until as until  # noqa: F401 - re-exported to the scaling tests

AGENT = """node_id: {node}
slots: {slots}
backend: synthetic
{controller}
engine_options: {{tokens_per_second: {tps}, lengths: {{kind: fixed, value: 100000}}{extra}}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
"""
TERMINAL = {scaling_pb2.OPERATION_STATE_ACTIVE, scaling_pb2.OPERATION_STATE_COMPLETED,
            scaling_pb2.OPERATION_STATE_FAILED, scaling_pb2.OPERATION_STATE_CANCELLED,
            scaling_pb2.OPERATION_STATE_NOOP}
STATE = scaling_pb2.OperationState.Name


class Procs:
    """Starts servers as processes (``rollmesh NAME``) and stops them all at the end."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = env
        self.stack = contextlib.ExitStack()
        self.procs: dict[str, tuple] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str, role: str, config: str, listen: str = "127.0.0.1:0") -> str:
        path = self.tmp / f"{name}.yaml"
        path.write_text(config)
        cm = running_server(role, ["--config", str(path), "--listen", listen], log_path=self.tmp / f"{name}.log",
                            env=self.env)
        address, proc = cm.__enter__()
        self.procs[name] = (cm, proc)
        self.addresses[name] = address
        return address

    def agent(self, node: str, *, controller: str = "", slots: int = 3, tps: int = 40, extra: str = "") -> str:
        return self.start(node, "replica-agent", AGENT.format(
            node=node, slots=slots, tps=tps, extra=extra,
            controller=f"controller_address: {controller}" if controller else ""))

    def kill(self, name: str) -> None:
        cm, proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with contextlib.suppress(Exception):
            cm.__exit__(None, None, None)

    def close(self) -> None:
        for cm, proc in reversed(list(self.procs.values())):
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
        self.procs.clear()


def controller_stub(channel) -> controller_pb2_grpc.ControllerServiceStub:
    """The controller's stub; its ``ops`` is google.longrunning.Operations on the same channel."""
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    stub.ops = operations_pb2_grpc.OperationsStub(channel)
    return stub


def scale_out_request(*, engine_addresses=(), **fields) -> scaling_pb2.ScaleOutRequest:
    """A ScaleOutRequest; ``engine_addresses`` go into its external target."""
    request = scaling_pb2.ScaleOutRequest(**fields)
    if engine_addresses:
        request.external.addresses.extend(engine_addresses)
    return request


def scale_in_request(*, replica_ids=(), engine_addresses=(), **fields) -> scaling_pb2.ScaleInRequest:
    """A ScaleInRequest; ``replica_ids`` and ``engine_addresses`` go into its replicas target."""
    request = scaling_pb2.ScaleInRequest(**fields)
    if replica_ids or engine_addresses:
        request.replicas.replica_ids.extend(replica_ids)
        request.replicas.engine_addresses.extend(engine_addresses)
    return request


def progress(operation: operations_pb2.Operation) -> scaling_pb2.ScaleOperation:
    """The ScaleOperation a google.longrunning.Operation carries as its metadata."""
    metadata = scaling_pb2.ScaleOperation()
    assert operation.metadata.Unpack(metadata), operation
    return metadata


def name(operation_id: str) -> str:
    return f"operations/{operation_id}"


async def scale_out(ctl, **fields) -> scaling_pb2.ScaleOperation:
    return progress(await ctl.ScaleOut(scale_out_request(**fields)))


async def scale_in(ctl, **fields) -> scaling_pb2.ScaleOperation:
    return progress(await ctl.ScaleIn(scale_in_request(**fields)))


async def get_op(ctl, operation_id: str) -> scaling_pb2.ScaleOperation:
    return progress(await ctl.ops.GetOperation(operations_pb2.GetOperationRequest(name=name(operation_id))))


async def cancel_op(ctl, operation_id: str, **call) -> scaling_pb2.ScaleOperation:
    """CancelOperation, then the operation as it is after it."""
    await ctl.ops.CancelOperation(operations_pb2.CancelOperationRequest(name=name(operation_id)), **call)
    return await get_op(ctl, operation_id)


async def list_ops(ctl, filter: str = "", **fields) -> list[scaling_pb2.ScaleOperation]:
    reply = await ctl.ops.ListOperations(operations_pb2.ListOperationsRequest(filter=filter, **fields))
    return [progress(o) for o in reply.operations]


def lb_stub(channel) -> loadbalancer_pb2_grpc.LoadBalancerServiceStub:
    return loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)


def agent_stub(channel) -> replica_agent_pb2_grpc.ReplicaAgentServiceStub:
    return replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)


async def routed(bal) -> list[str]:
    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return sorted(r.endpoint.replica_id for r in reply.replicas if r.routable)


async def in_flight(bal, replica_id: str) -> int:
    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return next((r.in_flight for r in reply.replicas if r.endpoint.replica_id == replica_id), 0)


async def replicas(ctl) -> dict[str, registry_pb2.ReplicaRecord]:
    return {r.replica_id: r for r in (await ctl.ListReplicas(registry_pb2.ListReplicasRequest())).replicas}


async def agent_states(address: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await agent_stub(channel).ListReplicas(agent_pb.ListReplicasRequest())
    return {r.replica_id: r.state for r in reply.replicas}


async def finished(ctl, operation_id: str, timeout_s: float = 90.0) -> scaling_pb2.ScaleOperation:
    """The operation once it has finished (google.longrunning.Operations.WaitOperation)."""
    reply = await ctl.ops.WaitOperation(operations_pb2.WaitOperationRequest(name=name(operation_id)),
                                        timeout=timeout_s)
    op = progress(reply)
    assert reply.done and op.state in TERMINAL, f"{operation_id} still {STATE(op.state)} after {timeout_s:g} s"
    return op


async def in_state(ctl, operation_id: str, state: int, timeout_s: float = 60.0) -> scaling_pb2.ScaleOperation:
    async def reached():
        op = await get_op(ctl, operation_id)
        assert op.state not in TERMINAL or op.state == state, f"{operation_id} ended {STATE(op.state)}"
        return op if op.state == state else None
    return await until(reached, timeout_s)


async def event_states(ctl, operation_id: str) -> list[str]:
    """The operation's state sequence as the event stream recorded it."""
    newest = (await ctl.GetStatus(controller_pb2.GetStatusRequest())).last_event_sequence
    call = ctl.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True))
    out = []
    try:
        async for message in call:  # unfiltered, so the newest event (any type) ends the replay
            event = message.event
            if event.type == events_pb2.EVENT_TYPE_OPERATION_STATE_CHANGED and event.operation_id == operation_id:
                out.append(event.to_state.removeprefix("OPERATION_STATE_"))
            if event.sequence >= newest:
                break
    finally:
        call.cancel()
    return out


async def events_of(ctl, event_type: int) -> list:
    newest = (await ctl.GetStatus(controller_pb2.GetStatusRequest())).last_event_sequence
    call = ctl.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True))
    out = []
    try:
        async for message in call:
            if message.event.type == event_type:
                out.append(message.event)
            if message.event.sequence >= newest:
                break
    finally:
        call.cancel()
    return out


async def generate(bal, request_id: str, max_tokens: int, prompt_len: int = 2):
    req = lb_pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1] * prompt_len,
                                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    final = None
    async for msg in bal.Generate(req, timeout=180):
        final = msg
    return final


async def black_hole() -> tuple[asyncio.AbstractServer, str]:
    """A TCP listener that accepts and never answers: gRPC calls to it hang until their deadline."""
    held = []

    async def hold(reader, writer):
        held.append(writer)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def closed_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def versions(bal) -> dict[str, int]:
    """replica id -> the weight version the load balancer routes it at."""
    reply = await bal.ListReplicas(lb_pb.ListReplicasRequest())
    return {r.endpoint.replica_id: r.endpoint.weight_version for r in reply.replicas}
