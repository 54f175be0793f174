"""Process entry points of ``rollmesh trainer-agent``: ``create_server`` and ``serve``."""

from __future__ import annotations

from mesh_runtime.server import ServerSpec
from rollmesh.trainer.v1 import trainer_agent_pb2_grpc

from .config import TrainerAgentConfig
from .service import DESCRIPTOR, TrainerAgentServicer

SPEC = ServerSpec(name="trainer-agent", config_class=TrainerAgentConfig, env_prefix="ROLLMESH_TRAINER_AGENT", descriptor=DESCRIPTOR,
                  make_servicer=TrainerAgentServicer,
                  add_to_server=trainer_agent_pb2_grpc.add_TrainerAgentServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create
serve = SPEC.serve
