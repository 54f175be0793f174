"""Process entry points of ``rollmesh replica-agent``: ``create_server`` and ``serve``."""

from __future__ import annotations

from mesh_runtime.server import ServerSpec
from rollmesh.replica.v1 import replica_agent_pb2_grpc

from .config import ReplicaAgentConfig
from .service import DESCRIPTOR, ReplicaAgentServicer

SPEC = ServerSpec(name="replica-agent", config_class=ReplicaAgentConfig, env_prefix="ROLLMESH_REPLICA_AGENT", descriptor=DESCRIPTOR,
                  make_servicer=lambda config, tracer_provider: ReplicaAgentServicer(config),
                  add_to_server=replica_agent_pb2_grpc.add_ReplicaAgentServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create
serve = SPEC.serve
