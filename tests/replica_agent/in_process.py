"""A real replica agent in this test's process (grpc.aio on port 0) with synthetic replicas that run until
max_tokens: for tests of the data path that need no separate process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from mesh_runtime.config import load_config
from mesh_runtime.server import MeshServer
from replica_agent.config import ReplicaAgentConfig
from replica_agent.server import SPEC


@contextlib.asynccontextmanager
async def synthetic_agent(replica_ids: list[str], *, tokens_per_second: float = 400,
                          engine_options: dict | None = None) -> AsyncIterator[tuple[MeshServer, str]]:
    """The agent's server and its address, stopped on exit. ``engine_options`` replace the pace options."""
    options = engine_options or {"tokens_per_second": tokens_per_second}
    config = load_config(ReplicaAgentConfig, None, overrides={
        "listen": "127.0.0.1:0", "node_id": "n0", "slots": len(replica_ids), "backend": "synthetic",
        "engine_options": {**options, "lengths": {"kind": "fixed", "value": 100000}},
        "replicas": [{"replica_id": r} for r in replica_ids]})
    server, port = await SPEC.create(config, None)
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
