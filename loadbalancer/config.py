"""Configuration of ``rollmesh lb``."""

from __future__ import annotations

import dataclasses

from mesh_runtime.config import ServerConfig, setting


@dataclasses.dataclass
class LoadBalancerConfig(ServerConfig):
    """Settings of the load balancer (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50052", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
