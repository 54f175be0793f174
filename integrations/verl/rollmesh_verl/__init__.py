"""rollmesh as a verl rollout backend and checkpoint engine (a verl plugin: no edits to verl).

``import verl`` loads this package through the ``verl.plugins`` entry point (installed with ``rollmesh[verl]``;
``VERL_USE_EXTERNAL_MODULES=rollmesh_verl`` does the same without it). It registers:

- the rollout replica ``rollmesh`` (``actor_rollout_ref.rollout.name=rollmesh``):
  :class:`~rollmesh_verl.replica.RollmeshReplica`, loaded when verl asks for it;
- the checkpoint-engine backend ``rollmesh`` (``actor_rollout_ref.rollout.checkpoint_engine.backend=rollmesh``):
  :class:`~rollmesh_verl.weights.RollmeshCheckpointEngine`.

Where the fleet is: ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollmesh`` (:mod:`.settings`).
docs/coming-from-verl.md has the overrides, a runnable example and what is not supported.
"""

from __future__ import annotations

from typing import Any


def _replica_class() -> Any:
    from .replica import RollmeshReplica  # noqa: PLC0415

    return RollmeshReplica


def register() -> None:
    """Register the replica and the checkpoint engine with verl's registries (idempotent)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry  # noqa: PLC0415

    RolloutReplicaRegistry.register("rollmesh", _replica_class)
    from . import weights  # noqa: F401, PLC0415 - registers the checkpoint engine on import


register()
