"""The registry on disk: one document per node, written when that node changes and only then."""

from __future__ import annotations

import json
import sqlite3

import grpc
import pytest

from controller.server import SPEC
from controller.store import StateStore
from mesh_runtime.config import load_config
from rollmesh.common.v1 import load_pb2, types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

pytestmark = pytest.mark.timeout(120)


async def start(tmp_path):
    config = load_config(SPEC.config_class, None, overrides={"listen": "127.0.0.1:0", "lease_ttl_s": 600,
                                                             "state_dir": str(tmp_path / "state")})
    server, port = await SPEC.create(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, controller_pb2_grpc.ControllerServiceStub(channel)


def registration(n: int) -> registry_pb2.RegisterNodeRequest:
    return registry_pb2.RegisterNodeRequest(node_id=f"node-{n}", address=f"127.0.0.1:{20000 + n}", slots_total=8,
                                            replicas=[registry_pb2.ReplicaRegistration(
                                                replica_id=f"node-{n}-r{i}", kind=types_pb2.REPLICA_KIND_STANDALONE,
                                                state=types_pb2.REPLICA_STATE_ACTIVE, slots=[i]) for i in range(8)])


@pytest.fixture
def written(monkeypatch):
    """Every document key the store writes (or deletes)."""
    keys: list[str] = []
    original = StateStore._write

    def spy(self, generation, documents, events):
        keys.extend(k for k, _ in documents)
        return original(self, generation, documents, events)

    monkeypatch.setattr(StateStore, "_write", spy)
    return keys


async def test_a_registration_writes_that_nodes_document_and_a_renewal_writes_none(tmp_path, written):
    server, channel, stub = await start(tmp_path)
    try:
        for n in range(100):
            await stub.RegisterNode(registration(n), timeout=10)
        written.clear()
        await stub.RegisterNode(registration(100), timeout=10)
        registry_keys = [k for k in written if k.startswith("registry/")]
        assert registry_keys == ["registry/node/node-100"]             # one node, not the fleet
        written.clear()

        async def reports():
            for _ in range(20):
                yield registry_pb2.StreamLoadReportsRequest(node_id="node-7", reports=[
                    load_pb2.LoadReport(replica_id=f"node-7-r{i}") for i in range(8)])
        async for _ in stub.StreamLoadReports(reports(), timeout=10):
            pass
        await server.stop(0)   # flushes whatever is pending: lease renewals are not durable changes
        assert [k for k in written if k.startswith("registry/")] == []
    finally:
        await channel.close()
        await server.stop(0)
    with sqlite3.connect(tmp_path / "state" / "controller.sqlite") as db:
        keys = [row[0] for row in db.execute("SELECT key FROM documents WHERE key LIKE 'registry%'")]
    assert len(keys) == 101 and "registry" not in keys
    server, channel, stub = await start(tmp_path)                       # and it all comes back
    try:
        replicas = (await stub.ListReplicas(registry_pb2.ListReplicasRequest(node_id="node-100"))).replicas
        assert [r.replica_id for r in replicas] == [f"node-100-r{i}" for i in range(8)]
        assert len((await stub.ListNodes(registry_pb2.ListNodesRequest())).nodes) == 101
    finally:
        await channel.close()
        await server.stop(0)


async def test_the_single_document_registry_of_earlier_releases_migrates(tmp_path):
    # the single-document format of earlier releases: read once, rewritten as one document per node
    state = tmp_path / "state"
    state.mkdir()
    old = {"lease_ttl_s": 10.0, "nodes": [{"node_id": "old-node", "address": "127.0.0.1:30000", "slots_total": 1}],
           "replicas": [{"replica_id": "old-r0", "node_id": "old-node", "address": "127.0.0.1:30000",
                         "kind": "STANDALONE", "state": "ACTIVE", "slots": [0]}]}
    with sqlite3.connect(state / "controller.sqlite") as db:
        db.execute("CREATE TABLE documents (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("CREATE TABLE events (sequence INTEGER PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO documents VALUES ('registry', ?)", (json.dumps(old),))
    server, channel, stub = await start(tmp_path)
    try:
        replica = await stub.GetReplica(registry_pb2.GetReplicaRequest(replica_id="old-r0"))
        assert replica.replica.node_id == "old-node"
        with sqlite3.connect(state / "controller.sqlite") as db:
            keys = {row[0] for row in db.execute("SELECT key FROM documents")}
        assert "registry" not in keys and "registry/node/old-node" in keys
    finally:
        await channel.close()
        await server.stop(0)
