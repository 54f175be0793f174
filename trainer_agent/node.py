"""One trainer node: its weight source and the weight broadcasts it sends.

:class:`TrainerNode` is what the trainer agent's servicer delegates to. At
start (once the gRPC server is bound, before it reports SERVING) it loads the
weights and hosts the rendezvous store of its broadcasts; at shutdown it
closes the process groups and the store and releases the model. With
``driver.enabled`` the fully-async training driver
(:class:`~trainer_agent.driver.runner.TrainingDriver`) runs here as a
background task of the server and publishes its updates through ``source``.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import tracing
from mesh_runtime.net import parse_host_port
from mesh_runtime.server import MeshServer
from mesh_runtime.status import node_name

from .broadcast import WeightBroadcaster
from .config import TrainerAgentConfig
from .driver.runner import TrainingDriver
from .weight_service import trainer_member_id
from .weight_source import TorchWeightSource, WeightSource, load_source_class

log = logging.getLogger(__name__)


class TrainerNode:
    """The trainer agent's domain object for this node."""

    def __init__(self, config: TrainerAgentConfig, tracer_provider: TracerProvider | None = None) -> None:
        self.config = config
        self.node_id = node_name(config.node_id)
        self.member_id = trainer_member_id(self.node_id)
        self.rank = 0
        self.world_size = 1
        self.source = create_weight_source(config)
        self.broadcaster = WeightBroadcaster(
            self.source, member_id=self.member_id, rendezvous=parse_host_port(config.weight_rendezvous),
            config=config.weight_transfer, tracer=tracing.tracer(tracer_provider, "rollmesh.trainer_agent"),
            # Without a training loop here nothing else would ever move the version on.
            adopt_newer_versions=config.adopt_requested_versions and not config.driver.enabled,
            served_dtype=config.served_dtype)
        self.driver = TrainingDriver(config, self.source, tracer_provider)

    async def start(self, server: MeshServer) -> None:
        """Load the weights and host the rendezvous store (called once the server is bound)."""
        server.add_cleanup(self.close)
        await asyncio.to_thread(self.source.load)
        await self.broadcaster.start()
        if self.config.driver.enabled:
            server.spawn(self.driver.run(), name="training-driver")

    async def close(self) -> None:
        await self.broadcaster.close()
        await asyncio.to_thread(self.source.close)


def create_weight_source(config: TrainerAgentConfig) -> WeightSource:
    """The weight source of ``config.weight_source`` or ``config.training_backend`` (not loaded yet)."""
    if config.weight_source:
        cls = load_source_class(config.weight_source)
        return cls(config.model, weight_version=config.initial_weight_version, seed=config.model_seed,
                   dtype=config.weight_dtype, **config.weight_source_options)
    if config.training_backend == "torch":
        return TorchWeightSource(config.model, seed=config.model_seed, dtype=config.weight_dtype,
                                 device=config.device, weight_version=config.initial_weight_version)
    if config.training_backend == "megatron":
        from .megatron.source import MegatronWeightSource  # noqa: PLC0415 - megatron-core only when chosen

        return MegatronWeightSource(config.model, seed=config.model_seed, dtype=config.weight_dtype,
                                    device=config.device, weight_version=config.initial_weight_version)
    raise ValueError(f"unknown training backend {config.training_backend!r}")
