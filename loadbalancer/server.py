"""Process entry points of ``rollmesh lb``: ``create_server`` and ``serve``."""

from __future__ import annotations

from mesh_runtime.server import ServerSpec
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc

from .config import LoadBalancerConfig
from .service import DESCRIPTOR, LoadBalancerServicer

SPEC = ServerSpec(name="lb", config_class=LoadBalancerConfig, env_prefix="ROLLMESH_LB", descriptor=DESCRIPTOR,
                  make_servicer=LoadBalancerServicer,
                  add_to_server=loadbalancer_pb2_grpc.add_LoadBalancerServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create
serve = SPEC.serve
