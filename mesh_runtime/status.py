"""Build the ``rollmesh.common.v1.ServerStatus`` every service returns from GetStatus."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from google.protobuf import struct_pb2
from rollmesh.common.v1 import status_pb2

from . import __version__
from .config import summary
from .durations import set_seconds
from .server import MeshServer


def node_name(configured: str) -> str:
    """The configured node id, or the host name when none is configured."""
    return configured or socket.gethostname()


_SECURITY = {"mutual_tls": status_pb2.TRANSPORT_SECURITY_MUTUAL_TLS,
             "plaintext_loopback": status_pb2.TRANSPORT_SECURITY_PLAINTEXT_LOOPBACK,
             "plaintext_insecure": status_pb2.TRANSPORT_SECURITY_PLAINTEXT_INSECURE}


def build_status(server: MeshServer, config: Any, capabilities: Iterable[str]) -> status_pb2.ServerStatus:
    """Status of a running server: identity, readiness, uptime, effective config."""
    status = status_pb2.ServerStatus(
        server_name=server.server_name, version=__version__,
        node_id=node_name(getattr(config, "node_id", "")),
        listen_address=server.address if server.port else server.listen,
        ready=server.ready, capabilities=sorted(capabilities),
        transport_security=_SECURITY[server.transport_security],
        identity=server.identity.uri if server.identity else "")
    set_seconds(status.started_at, server.started_at)
    set_seconds(status.uptime, server.uptime_s())
    struct = struct_pb2.Struct()
    struct.update(_jsonable(summary(config)))
    status.config.CopyFrom(struct)
    return status


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class StatusReporter:
    """What a servicer needs to answer GetStatus; bound to its server at build time."""

    def __init__(self, config: Any, capabilities: Iterable[str]) -> None:
        self.config = config
        self.capabilities = frozenset(capabilities)
        self.server: MeshServer | None = None

    def bind(self, server: MeshServer) -> None:
        self.server = server

    def status(self) -> status_pb2.ServerStatus:
        if self.server is None:
            raise RuntimeError("StatusReporter used before bind()")
        return build_status(self.server, self.config, self.capabilities)
