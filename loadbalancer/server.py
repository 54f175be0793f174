"""Process entry points of ``rollmesh lb``: ``create_server`` and ``serve`` (one balancer, or
``workers`` of them, :mod:`.workers`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mesh_runtime.server import ServerSpec
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc

from .config import LoadBalancerConfig
from .service import DESCRIPTOR, LoadBalancerServicer, own_name
from .workers import serve_workers

SPEC = ServerSpec(name="lb", config_class=LoadBalancerConfig, env_prefix="ROLLMESH_LB", descriptor=DESCRIPTOR,
                  make_servicer=LoadBalancerServicer,
                  add_to_server=loadbalancer_pb2_grpc.add_LoadBalancerServiceServicer_to_server)
CONFIG_CLASS = SPEC.config_class
ENV_PREFIX = SPEC.env_prefix
build_server = SPEC.build
create_server = SPEC.create


async def serve(config: LoadBalancerConfig, env: dict[str, str]) -> None:
    """Serve until signalled: this process is the balancer, or with ``workers`` > 1 it supervises that many
    balancer processes, each started from its share of this effective config (written to private files)."""
    if config.workers == 1:
        await SPEC.serve(config, env)
        return
    with tempfile.TemporaryDirectory(prefix="rollmesh-lb-") as tmp:
        await serve_workers(config, Path(tmp), env, config.balancer_id or own_name(config))
