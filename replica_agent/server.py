"""Process entry points of ``rollmesh replica-agent``: ``create_server`` and ``serve``."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.server import ServerSpec
from rollmesh.replica.v1 import replica_agent_pb2_grpc

from .config import ReplicaAgentConfig
from .service import DESCRIPTOR, ReplicaAgentServicer


def make_servicer(config: ReplicaAgentConfig, tracer_provider: TracerProvider | None) -> ReplicaAgentServicer:
    """The agent's servicer: its replicas in this process, or each in a process of its own."""
    if config.replica_processes:
        from .process_service import ProcessReplicaAgentServicer  # noqa: PLC0415

        return ProcessReplicaAgentServicer(config, tracer_provider)
    return ReplicaAgentServicer(config)


SPEC = ServerSpec(name="replica-agent", config_class=ReplicaAgentConfig, env_prefix="ROLLMESH_REPLICA_AGENT", descriptor=DESCRIPTOR,
                  make_servicer=make_servicer,
                  add_to_server=replica_agent_pb2_grpc.add_ReplicaAgentServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create
serve = SPEC.serve
