"""Configuration of ``rollmesh replica-agent``."""

from __future__ import annotations

import dataclasses

from mesh_runtime.config import ServerConfig, setting


@dataclasses.dataclass
class ReplicaAgentConfig(ServerConfig):
    """Settings of the replica agent (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50053", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
