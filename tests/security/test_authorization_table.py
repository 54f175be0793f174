"""Every RPC of every server against every role: the authorization table, enforced on real servers.

Each server runs in-process with mutual TLS; each RPC is called (with an
empty request) once per role, through a channel presenting that role's
certificate. A role the table does not allow gets PERMISSION_DENIED naming the
roles required, before the handler runs; an allowed role gets past the
authorization (its empty request may still be refused by the handler for what
it is). A new RPC without a rule fails here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

import controller.server
import loadbalancer.server
import replica_agent.server
import trainer_agent.server
from mesh_runtime.authorization import RULES
from mesh_runtime.channels import open_channel
from mesh_runtime.config import load_config
from mesh_runtime.errors import error_info
from mesh_runtime.identity import ROLES

pytestmark = pytest.mark.timeout(120)

MODULES = {
    "controller": (controller.server, {}),
    "lb": (loadbalancer.server, {}),
    "replica-agent": (replica_agent.server, {"replicas": [], "controller_address": "127.0.0.1:9"}),
    "trainer-agent": (trainer_agent.server, {}),
}
COMMON = ["grpc.health.v1.Health"]
WEIGHTS = "rollmesh.weights.v1.WeightSourceService"
OPERATIONS = "google.longrunning.Operations"
ALSO_SERVED = {"controller": [OPERATIONS], "replica-agent": [WEIGHTS],
               "trainer-agent": [WEIGHTS]}   # besides the server's own service
_DENIED = {"ROLE_NOT_ALLOWED", "NO_RULE", "NO_IDENTITY"}
PROTO = Path(__file__).resolve().parents[2] / "proto"


def _descriptor(full_name: str):
    from google.protobuf import descriptor_pool
    from google.longrunning import operations_pb2  # noqa: F401 - registers google.longrunning in the pool
    from grpc_health.v1 import health_pb2  # noqa: F401 - registers grpc.health.v1 in the pool
    from rollmesh.weights.v1 import weight_source_pb2  # noqa: F401

    return descriptor_pool.Default().FindServiceByName(full_name)


def _services() -> list:
    """Every rollmesh service some server serves."""
    names = {module.SPEC.descriptor.full_name for module, _ in MODULES.values()}
    return [_descriptor(n) for n in sorted(names | {n for also in ALSO_SERVED.values() for n in also})]


def test_every_rpc_of_every_service_has_exactly_one_rule():
    for service in _services():
        assert set(RULES[service.full_name]) == {m.name for m in service.methods}, service.full_name
    health = _descriptor("grpc.health.v1.Health")
    assert set(RULES[health.full_name]) >= {m.name for m in health.methods}


def test_the_contract_comments_state_every_rule():
    # the comment above each rpc in the .proto says "Authorization: <the table's text>."; Google's
    # google.longrunning.Operations has its rules in scaling.proto's header instead
    from mesh_runtime.authorization import describe

    for service in _services():
        if service.full_name == OPERATIONS:
            header = " ".join(w for line in (PROTO / "rollmesh/controller/v1/scaling.proto").read_text().splitlines()
                              if line.startswith("//") for w in line.removeprefix("//").split())
            assert "Get, Wait and List: any authenticated identity; Cancel and Delete: operator" in header
            assert {"GetOperation", "WaitOperation", "ListOperations", "CancelOperation", "DeleteOperation"} == {
                m.name for m in service.methods}
            continue
        source = (PROTO / service.file.name).read_text()
        for method in service.methods:
            before = source.split(f"rpc {method.name}(")[0].rsplit(";\n", 1)[-1]   # back to the previous rpc
            comment = " ".join(w for line in before.splitlines() if line.strip().startswith("//")
                               for w in line.strip().removeprefix("//").split())
            line = f"Authorization: {describe(service.full_name, method.name)}."
            assert line in comment, f"{service.name}.{method.name}: the comment lacks {line!r}"


async def _call(channel: grpc.aio.Channel, service: str, method) -> tuple[grpc.StatusCode, str]:
    path = f"/{service}/{method.name}"
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if method.client_streaming:
            factory = channel.stream_stream if method.server_streaming else channel.stream_unary
            call = factory(path, **ident)(iter([b""]), timeout=1.5)
        else:
            factory = channel.unary_stream if method.server_streaming else channel.unary_unary
            call = factory(path, **ident)(b"", timeout=1.5)
        if method.server_streaming:
            await call.read()
            call.cancel()
        else:
            await call
    except grpc.aio.AioRpcError as err:
        info = error_info(err)
        return err.code(), info.reason if info is not None else ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("name", list(MODULES))
async def test_each_role_is_allowed_exactly_what_the_table_says(name, pki):
    module, overrides = MODULES[name]
    own = {"controller": "controller", "lb": "lb", "replica-agent": "replica-agent",
           "trainer-agent": "trainer-agent"}[name]
    config = load_config(module.CONFIG_CLASS, None,
                         overrides={"listen": "127.0.0.1:0", "tls": pki.section(own), **overrides})
    server, port = await module.SPEC.create(config)
    try:
        channels = {role: open_channel(f"127.0.0.1:{port}", tls=pki.tls(role)) for role in ROLES}
        services = [module.SPEC.descriptor.full_name, *ALSO_SERVED.get(name, []), *COMMON]
        assert [b.full_name for b in server.services] == services[:-len(COMMON)]
        cases = [(role, service, m) for role in ROLES for service in services
                 for m in _descriptor(service).methods]
        results = await asyncio.gather(*(_call(channels[r], s, m) for r, s, m in cases))
        wrong = []
        for (role, service, method), (code, reason) in zip(cases, results):
            allowed = role in RULES[service][method.name].roles
            denied = code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) \
                and reason in _DENIED
            if allowed == denied:
                wrong.append(f"{method.name} as {role}: {code.name} {reason}")
        assert not wrong, wrong
        for channel in channels.values():
            await channel.close()
    finally:
        await server.stop(0)
