"""verl's checkpoint-engine backend ``rollmesh``: the trainer's weights reach the fleet through rollmesh's broadcast.

verl's ``CheckpointEngineManager.update_weights`` calls ``send_weights`` on every trainer worker (each iterates the
model's per-tensor parameters, a collective gather under FSDP or Megatron) and ``receive_weights`` on every rollout
worker. With this backend:

- the trainer's rank 0 (``is_master``) writes the gathered tensors as version ``global_steps`` into ``weights_dir``
  (``DIR/<version>.safetensors``, written under a temporary name then renamed: never read half-written), the
  directory the node's trainer agent reads (``weight_source: trainer_agent.published_weights:
  DirectoryWeightSource``), then calls the controller's ``SyncWeights``: the controller broadcasts the version to
  every standalone and active hybrid replica (gloo on CPU, NCCL on GPU, manifests signed on a secure mesh) and
  commits it fleet-wide: a replica that fails to take it leaves routing until it holds the current version, so no
  routed replica serves another version and requests pinned by ``min_weight_version`` behave as with rollmesh's
  own trainer. Once the controller answers, the agent holds the version and the older files are deleted (one
  file per step would fill the disk). The other ranks take part in the gather and drop what they read;
- the rollout side receives nothing through verl: rollmesh's replicas get the weights from rollmesh's broadcast,
  which builds its own process groups, so ``prepare``, ``build_topology``, ``init_process_group`` and ``finalize``
  have no group of verl's to build or free.

``send_weights`` returns metrics under ``rollmesh/`` (verl merges them into the step's): the seconds spent writing
and syncing, the bytes the broadcast sent, the replicas that took the version and the ones that did not.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from .settings import SECTION, mesh_settings

log = logging.getLogger(__name__)


class WeightSyncFailed(RuntimeError):
    """The fleet could not take a weight version."""


@CheckpointEngineRegistry.register("rollmesh")
class RollmeshCheckpointEngine(CheckpointEngine):
    """See the module docstring. ``is_master``: True on the trainer's rank 0, False on its other ranks, unset on
    the rollout side (verl's ``CheckpointEngineWorker`` passes none)."""

    def __init__(self, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = mesh_settings(engine_kwargs)
        if is_master and not self.settings.weights_dir:
            from mesh_runtime.config import ConfigError  # noqa: PLC0415

            raise ConfigError(f"{SECTION}.weights_dir", "is required on the trainer: the directory the trainer "
                                                        "agent's DirectoryWeightSource reads")

    def prepare(self) -> dict[str, Any]:
        """No buffers to allocate: the broadcast is rollmesh's (see the module docstring)."""
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No topology of verl's: the controller plans rollmesh's broadcast."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """No process group of verl's (see :meth:`build_topology`)."""

    def finalize(self) -> None:
        """Nothing to free (see :meth:`prepare`)."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Rank 0: write version ``global_steps``, have the controller broadcast and commit it; other ranks: take
        part in the gather."""
        from verl.workers.rollout.utils import ensure_async_iterator  # noqa: PLC0415

        if not self.is_master:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if global_steps is None:
            raise WeightSyncFailed("the rollmesh backend needs the trainer's global_steps as the weight version")
        self._check_not_behind(int(global_steps))
        started = time.perf_counter()
        tensors = {}
        async for name, tensor in ensure_async_iterator(weights):
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        from weight_transfer.published import prune, publish  # noqa: PLC0415

        publish(self.settings.weights_dir, tensors, int(global_steps))
        written = time.perf_counter()
        result = await self._sync(int(global_steps))
        prune(self.settings.weights_dir, below=int(global_steps))   # the trainer agent holds this one now
        ok = [r.replica_id for r in result.replica_results if r.ok]
        failed = {r.replica_id: r.error_message for r in result.replica_results if not r.ok}
        if failed:
            log.warning("rollmesh: version %d not taken by %s; they left routing until they hold the current "
                        "version", global_steps, ", ".join(f"{k} ({v[:120]})" for k, v in failed.items()))
        if failed and not ok:
            raise WeightSyncFailed(f"rollmesh: no replica took weight version {global_steps}: " + "; ".join(
                f"{k}: {v[:200]}" for k, v in failed.items()))
        return {"rollmesh/publish_s": written - started, "rollmesh/sync_s": time.perf_counter() - written,
                "rollmesh/bytes_sent": float(result.bytes_sent), "rollmesh/replicas_synced": float(len(ok)),
                "rollmesh/replicas_failed": float(len(failed))}

    def _check_not_behind(self, version: int) -> None:
        """A directory holding a newer version than ``version`` is an earlier run's: the fleet's trainer agent
        serves that one and versions only grow, so this run's would never be taken. Say so before sending."""
        from weight_transfer.published import published_versions  # noqa: PLC0415

        newer = [v for v in published_versions(self.settings.weights_dir) if v > version]
        if newer:
            raise WeightSyncFailed(
                f"rollmesh: {self.settings.weights_dir} holds weight version {max(newer)}, newer than this run's "
                f"{version}: the fleet serves an earlier run's versions (they only grow). Start a fresh fleet (an "
                f"empty {SECTION}.weights_dir for its trainer agent) or resume verl from its checkpoint of step "
                f"{max(newer)} or later")

    async def _sync(self, version: int) -> Any:
        import grpc  # noqa: PLC0415

        from mesh_runtime.channels import open_channel  # noqa: PLC0415
        from mesh_runtime.durations import set_seconds  # noqa: PLC0415
        from rollmesh.controller.v1 import controller_pb2_grpc, weight_sync_pb2  # noqa: PLC0415

        request = weight_sync_pb2.SyncWeightsRequest(weight_version=version, request_id=f"verl-{uuid.uuid4().hex}")
        set_seconds(request.timeout, self.settings.sync_timeout_s)
        channel = open_channel(self.settings.controller, tls=self.settings.tls)
        try:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            reply = await stub.SyncWeights(request, timeout=self.settings.sync_timeout_s + self.settings.call_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise WeightSyncFailed(f"rollmesh: SyncWeights of version {version} at {self.settings.controller}: "
                                   f"{err.code().name}: {err.details()}") from None
        finally:
            await channel.close()
        return reply.result

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:
        """Nothing arrives through verl: the replicas receive rollmesh's broadcast."""
        return
        yield   # an async generator that yields nothing
