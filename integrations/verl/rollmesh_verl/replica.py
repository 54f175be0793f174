"""verl's rollout replica ``rollmesh`` (``actor_rollout_ref.rollout.name=rollmesh``): a handle on the rollmesh fleet.

verl makes one replica per ``rollout.nnodes x rollout.n_gpus_per_node / (tp x dp x pp)`` and sizes its rollouter's
concurrency by their number, so set those to the fleet's standalone replicas. A ``RollmeshReplica`` launches no
engine and reserves no GPU: its server is a :class:`~rollmesh_verl.server.RollmeshServer` actor that sends verl's
requests through rollmesh's balancer, which picks the fleet's replica (rollmesh's routing), and the same actor is
the replica's one rollout worker for verl's ``CheckpointEngineManager``. Before the first replica starts, the fleet
is checked (:mod:`.checks`): reachable with these credentials, serving verl's model, with a supported verl.

Standalone only: verl's hybrid and colocated replicas run an engine inside verl's own trainer workers, which a
rollmesh replica cannot be; ``init_hybrid``, ``init_hybrid_colocated`` and ``init_colocated`` say so.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .checks import check_fleet
from .server import ControlledByRollmesh, RollmeshServer
from .settings import from_rollout_config

_HYBRID = ("verl's {} replicas run an engine inside verl's trainer workers; a rollmesh replica is served by the "
           "rollmesh fleet. Use rollout.nnodes / n_gpus_per_node for the fleet's standalone replicas, and let "
           "rollmesh's controller lend trainer GPUs to rollout (rollmesh hybrid replicas)")


class RollmeshReplica(RolloutReplica):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = from_rollout_config(self.config)   # a bad block fails here, before anything starts

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_hybrid(self, worker_group: Any) -> None:
        raise ControlledByRollmesh(_HYBRID.format("hybrid"))

    async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
        raise ControlledByRollmesh(_HYBRID.format("hybrid"))

    async def init_colocated(self, resource_pool: Any) -> None:
        raise ControlledByRollmesh(_HYBRID.format("colocated"))

    async def launch_servers(self) -> None:
        engine_kwargs = dict(self.config.checkpoint_engine.engine_kwargs["rollmesh"])
        await check_fleet(self.settings, self.model_config)
        # unique per manager: verl may build several managers in one Ray session (a restart, tests)
        name = f"rollmesh_server_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:8]}"
        actor = ray.remote(RollmeshServer).options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
        handle = actor.remote(engine_kwargs, replica_rank=self.replica_rank,
                              response_length=int(self.config.response_length),
                              prompt_length=int(self.config.prompt_length))
        await handle.ping.remote()   # the actor's construction errors surface here
        self.servers = [handle]
        self.workers = [handle]
        self._server_handle = handle
        self._server_address = f"rollmesh/{name}"
