"""The contract's REQUIRED fields ((google.api.field_behavior) = REQUIRED) are what every server refuses unset.

The check is generic (mesh_runtime.decoding.check_required in every server's ServerPipeline, after
authorization, before any servicer), so these tests walk the contract: every REQUIRED field of every request message, at the depth it
is declared, is refused when left unset with INVALID_ARGUMENT / REQUIRED_FIELD_MISSING naming its path,
and a request with every REQUIRED field set passes. (tests/security/test_authorization_table.py sends empty
requests: a caller that may not call a method gets PERMISSION_DENIED, not this.)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

import loadbalancer.server
from mesh_runtime.config import load_config
from mesh_runtime.decoding import check_required, decode, required_fields
from mesh_runtime.errors import InvalidArgument, error_info
from mesh_runtime.reasons import Reason
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("rollmesh.controller.v1.controller_pb2", "rollmesh.loadbalancer.v1.loadbalancer_pb2",
            "rollmesh.replica.v1.replica_agent_pb2", "rollmesh.trainer.v1.trainer_agent_pb2",
            "rollmesh.weights.v1.weight_source_pb2")


def _request_types() -> list[Descriptor]:
    seen: dict[str, Descriptor] = {}
    for module in SERVICES:
        for service in importlib.import_module(module).DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                seen.setdefault(method.input_type.full_name, method.input_type)
    return sorted(seen.values(), key=lambda d: d.full_name)


def _fill(message: Message, field: FieldDescriptor) -> None:
    """Set ``field`` to a value that counts as given (and, for a message, its own REQUIRED fields)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        sub = getattr(message, field.name).add() if field.is_repeated else getattr(message, field.name)
        sub.SetInParent()
        for inner in required_fields(field.message_type):
            _fill(sub, inner)
        return
    value: object = {FieldDescriptor.TYPE_STRING: "x", FieldDescriptor.TYPE_BYTES: b"x",
                     FieldDescriptor.TYPE_BOOL: True}.get(field.type, 1)
    if field.type == FieldDescriptor.TYPE_ENUM:
        value = field.enum_type.values[1].number
    if field.is_repeated:
        getattr(message, field.name).append(value)
    else:
        setattr(message, field.name, value)


def _complete(descriptor: Descriptor, cls: type[Message]) -> Message:
    message = cls()
    for field in required_fields(descriptor):
        _fill(message, field)
    return message


def _cases() -> Iterator[tuple[str, Descriptor, list[str]]]:
    """(request type, its descriptor, path to one REQUIRED field) for every REQUIRED field reachable by
    REQUIRED messages or by one element of a repeated/singular message field."""
    for descriptor in _request_types():
        for field in required_fields(descriptor):
            yield descriptor.full_name, descriptor, [field.name]
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
                for inner in required_fields(field.message_type):
                    yield descriptor.full_name, descriptor, [field.name, inner.name]


def _class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


CASES = list(_cases())


def test_the_contract_marks_required_fields_and_no_prose_says_so():
    assert len(CASES) >= 20
    prose = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "proto").rglob("*.proto")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if line.strip().startswith("//") and "Required." in line]
    assert not prose, prose


def test_a_request_with_every_required_field_passes():
    for descriptor in _request_types():
        message = _complete(descriptor, _class(descriptor))
        decoded = decode(type(message).FromString, message.SerializeToString(), "/m")
        assert check_required(decoded, "/m") == message, descriptor.full_name


@pytest.mark.parametrize("type_name, descriptor, path", CASES, ids=[f"{c[0]}.{'.'.join(c[2])}" for c in CASES])
def test_each_required_field_left_unset_is_refused_naming_it(type_name, descriptor, path):
    message = _complete(descriptor, _class(descriptor))
    if len(path) == 2:   # make sure the holder exists, then clear the inner field
        holder_field = descriptor.fields_by_name[path[0]]
        if not (holder_field.is_repeated and len(getattr(message, path[0]))) and not (
                not holder_field.is_repeated and message.HasField(path[0])):
            _fill(message, holder_field)
        holder = getattr(message, path[0])
        holder = holder[0] if holder_field.is_repeated else holder
        holder.ClearField(path[1])
        expected = f"{path[0]}[0].{path[1]}" if holder_field.is_repeated else f"{path[0]}.{path[1]}"
    else:
        message.ClearField(path[0])
        expected = path[0]
    with pytest.raises(InvalidArgument) as info:
        check_required(decode(type(message).FromString, message.SerializeToString(), "/pkg.Service/Method"),
                       "/pkg.Service/Method")
    assert info.value.reason == Reason.REQUIRED_FIELD_MISSING
    assert info.value.metadata == {"field": expected}
    assert f"{expected} is required" in info.value.message


async def test_a_server_answers_a_missing_required_field_before_its_servicer_runs():
    server, port = await loadbalancer.server.SPEC.create(load_config(
        loadbalancer.server.CONFIG_CLASS, None, overrides={"listen": "127.0.0.1:0"}))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RemoveReplicas(loadbalancer_pb2.RemoveReplicasRequest(), timeout=10)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "replica_ids is required" in info.value.details()
            reason = error_info(info.value)
            assert reason is not None and reason.reason == "REQUIRED_FIELD_MISSING"
            assert dict(reason.metadata) == {"field": "replica_ids"}
    finally:
        await server.stop(0)
