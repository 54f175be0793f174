"""verl's checkpoint-engine backend ``rollmesh``: the trainer's weights reach the fleet through rollmesh's broadcast.

verl's ``CheckpointEngineManager.update_weights`` calls ``send_weights`` on every trainer worker (each iterates the
model's per-tensor parameters, a collective gather under FSDP or Megatron) and ``receive_weights`` on every rollout
worker. With this backend:

- the trainer's rank 0 (``is_master``) copies the gathered tensors to host memory (the trainer goes on training
  them in place) and hands them over, as version ``global_steps``, to a ``WeightSourceService`` it serves from its
  own process (:class:`trainer_agent.in_process.InProcessWeightServer`, started at the first update on
  ``source_listen``), then calls the controller's ``SyncWeights`` naming that server: the controller prepares and
  broadcasts the version from there, exactly as from a trainer agent (a delta from the version the fleet holds
  when that is smaller, gloo on CPU, NCCL on GPU, manifests signed on a secure mesh), and commits it fleet-wide:
  a replica that fails to take it leaves routing until it holds the current version, so no routed replica serves
  another version and requests pinned by ``min_weight_version`` behave as with rollmesh's own trainer;
- or, with ``weights_dir``, rank 0 writes the version as ``DIR/<version>.safetensors`` (written under a temporary
  name, then renamed: never read half-written) for a trainer agent's ``DirectoryWeightSource`` and names no
  source: the controller broadcasts from its trainer agent. Once the controller answers, the agent holds the
  version and the older files are deleted (one file per step would fill the disk);
- the other ranks take part in the gather and drop what they read;
- the rollout side receives nothing through verl: rollmesh's replicas get the weights from rollmesh's broadcast,
  which builds its own process groups, so ``prepare``, ``build_topology``, ``init_process_group`` and ``finalize``
  have no group of verl's to build or free.

Either way, a fleet that holds a newer version than ``global_steps`` (an earlier run's: versions only grow) fails
the first update before anything is sent, naming both.

``send_weights`` returns metrics under ``rollmesh/`` (verl merges them into the step's): the seconds spent handing
over (or writing) and syncing, the bytes the broadcast sent, the replicas that took the version and the ones that
did not.
"""

from __future__ import annotations

import atexit
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
        self._checked_fleet = False

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
        """Rank 0: hand over (or write) version ``global_steps``, have the controller broadcast and commit it;
        other ranks: take part in the gather."""
        from verl.workers.rollout.utils import ensure_async_iterator  # noqa: PLC0415

        if not self.is_master:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if global_steps is None:
            raise WeightSyncFailed("the rollmesh backend needs the trainer's global_steps as the weight version")
        version = int(global_steps)
        await self._check_not_behind(version)
        started = time.perf_counter()
        tensors = {}
        async for name, tensor in ensure_async_iterator(weights):
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        from weight_transfer.published import prune, publish  # noqa: PLC0415

        if self.settings.weights_dir:
            publish(self.settings.weights_dir, tensors, version)
            source = ""
        else:
            server = _weight_server(self.settings)
            if server.weight_version != version:   # the same step again: the version it holds is sent again
                server.hand_over(tensors, version)
            source = server.address
        del tensors
        handed = time.perf_counter()
        result = await self._sync(version, source)
        if self.settings.weights_dir:
            prune(self.settings.weights_dir, below=version)   # the trainer agent holds this one now
        ok = [r.replica_id for r in result.replica_results if r.ok]
        failed = {r.replica_id: r.error_message for r in result.replica_results if not r.ok}
        if failed:
            log.warning("rollmesh: version %d not taken by %s; they left routing until they hold the current "
                        "version", global_steps, ", ".join(f"{k} ({v[:120]})" for k, v in failed.items()))
        if failed and not ok:
            raise WeightSyncFailed(f"rollmesh: no replica took weight version {global_steps}: " + "; ".join(
                f"{k}: {v[:200]}" for k, v in failed.items()))
        return {"rollmesh/publish_s": handed - started, "rollmesh/sync_s": time.perf_counter() - handed,
                "rollmesh/bytes_sent": float(result.bytes_sent), "rollmesh/replicas_synced": float(len(ok)),
                "rollmesh/replicas_failed": float(len(failed))}

    async def _check_not_behind(self, version: int) -> None:
        """A fleet that holds a newer version than ``version`` served an earlier run (versions only grow), and
        would never take this run's. Say so before sending: once per process for the replicas' versions, and at
        every update for what rank 0 serves (the versions ``weights_dir`` holds: its trainer agent serves the
        newest)."""
        newer: list[int] = []
        if self.settings.weights_dir:
            from weight_transfer.published import published_versions  # noqa: PLC0415

            newer = [v for v in published_versions(self.settings.weights_dir) if v > version]
            where = f"{self.settings.weights_dir} holds"
        else:
            held = _weight_server(self.settings).weight_version
            newer = [held] if held is not None and held > version else []
            where = "this process serves"
        if not newer and not self._checked_fleet:
            from .checks import list_fleet  # noqa: PLC0415

            _, replicas = await list_fleet(self.settings)
            newer = [r.weight_version for r in replicas if r.weight_version > version]
            where = "the fleet's replicas hold"
        self._checked_fleet = True
        if newer:
            raise WeightSyncFailed(
                f"rollmesh: {where} weight version {max(newer)}, newer than this run's {version}: the fleet "
                f"serves an earlier run's versions (they only grow). Start a fresh fleet (and an empty "
                f"{SECTION}.weights_dir if you use one) or resume verl from its checkpoint of step {max(newer)} "
                "or later")

    async def _sync(self, version: int, source: str) -> Any:
        import grpc  # noqa: PLC0415

        from mesh_runtime.channels import open_channel  # noqa: PLC0415
        from mesh_runtime.durations import set_seconds  # noqa: PLC0415
        from rollmesh.controller.v1 import controller_pb2_grpc, weight_sync_pb2  # noqa: PLC0415

        request = weight_sync_pb2.SyncWeightsRequest(weight_version=version, request_id=f"verl-{uuid.uuid4().hex}",
                                                     source_address=source)
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


_SERVERS: dict[tuple, Any] = {}
"""The weight servers of this process by settings: one for the life of the process (the controller keeps its
address for later syncs: scale-outs with no seed, hybrid replicas waking)."""


def _weight_server(settings: Any) -> Any:
    """Rank 0's :class:`~trainer_agent.in_process.InProcessWeightServer` for ``settings``, started at first use."""
    key = (settings.source_listen, settings.served_dtype, settings.source_threads, repr(settings.tls))
    if key not in _SERVERS:
        from mesh_runtime.net import is_wildcard, parse_host_port  # noqa: PLC0415
        from trainer_agent.in_process import InProcessWeightServer  # noqa: PLC0415

        host = ""
        if is_wildcard(parse_host_port(settings.source_listen)[0]):
            import ray  # noqa: PLC0415

            host = ray.util.get_node_ip_address()
        server = InProcessWeightServer(listen=settings.source_listen, advertise_host=host, tls=settings.tls,
                                       served_dtype=settings.served_dtype, timeout_s=settings.sync_timeout_s,
                                       threads=settings.source_threads)
        server.start()
        atexit.register(server.close)
        _SERVERS[key] = server
    return _SERVERS[key]
