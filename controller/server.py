"""Process entry points of ``rollmesh controller``: ``create_server`` and ``serve``."""

from __future__ import annotations

from mesh_runtime.server import ServerSpec
from rollmesh.controller.v1 import controller_pb2_grpc

from .config import ControllerConfig
from .service import DESCRIPTOR, ControllerServicer

SPEC = ServerSpec(name="controller", config_class=ControllerConfig, env_prefix="ROLLMESH_CONTROLLER",
                  descriptor=DESCRIPTOR, make_servicer=ControllerServicer,
                  add_to_server=controller_pb2_grpc.add_ControllerServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create
serve = SPEC.serve
