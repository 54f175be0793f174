"""Configuration of ``rollmesh controller``."""

from __future__ import annotations

import dataclasses

from mesh_runtime.config import ConfigError, ServerConfig, setting
from mesh_runtime.net import AddressError, parse_host_port


@dataclasses.dataclass
class ControllerConfig(ServerConfig):
    """Settings of the controller (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50051", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    load_balancer_address: str = setting("", help="HOST:PORT of the load balancer whose routing table "
                                                  "this controller maintains; empty = none configured")
    peer_timeout_s: float = setting(2.0, help="deadline in seconds for each call the controller makes "
                                              "to probe a peer in GetStatus")

    def validate(self) -> None:
        super().validate()
        if self.load_balancer_address:
            try:
                parse_host_port(self.load_balancer_address, allow_zero_port=False)
            except AddressError as err:
                raise ConfigError("load_balancer_address", str(err)) from None
        if not 0 < self.peer_timeout_s <= 60:
            raise ConfigError("peer_timeout_s", f"must be in (0, 60] seconds, got {self.peer_timeout_s}")
