"""Configuration of ``rollmesh trainer-agent``."""

from __future__ import annotations

import dataclasses

from mesh_runtime.config import ServerConfig, setting


@dataclasses.dataclass
class TrainerAgentConfig(ServerConfig):
    """Settings of the trainer agent (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50054", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
