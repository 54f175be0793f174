"""Loading a Hugging Face safetensors checkpoint from this node's disk into replicas: the agent's part of the
controller's ``LoadWeights`` (SGLang's ``update_weights_from_disk``, flipped fleet-wide).

The controller runs it in steps so that a fleet moves to the new version together or not at all:

- ``CHECK`` reads the checkpoint's headers (no tensor data) and compares them with each replica's weights:
  every weight the replica serves must be there with its shape; floating-point tensors are cast to the served
  dtype, others must match. With ``keep_previous`` it also checks that the replica can hand its weights over
  for keeping (awake, and an engine that can export them). Nothing changes.
- ``INSTALL`` reads the tensors and swaps them in as the new version, as a weight broadcast would: the replica
  is SYNCING meanwhile, its in-flight requests are aborted (they resume through the balancer) and a failure
  leaves the old weights serving. With ``keep_previous`` the replaced weights (and version) are kept on the
  host under the update's id, one update per replica at a time.
- ``RELEASE`` drops what ``INSTALL`` kept; ``REVERT`` swaps it back in.

A replica's failure is its result (``ok`` false, why), not the call's: the controller decides what it means
for the rest of the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason

from .engines.checkpoint_spec import FLOAT_DTYPES, checkpoint_spec
from .engines.types import WeightSpec
from .replicas import Replica, ReplicaManager
from .syncing import swapping_weights
from .weights import ReceiveResult

log = logging.getLogger(__name__)

STEPS = ("CHECK", "INSTALL", "RELEASE", "REVERT")
_CANNOT_LOAD = ("LAUNCHING", "LOADING", "FAILED", "STOPPED")


@dataclasses.dataclass
class _Kept:
    update_id: str
    version: int
    tensors: dict[str, Any]


class CheckpointLoads:
    """The steps of checkpoint loads on one node's replicas, and the weights kept for a revert."""

    def __init__(self, manager: ReplicaManager) -> None:
        self.manager = manager
        self.kept: dict[str, _Kept] = {}
        """replica id -> the weights an INSTALL with keep_previous replaced."""

    async def run(self, replica_ids: list[str], step: str, *, path: str, version: int, update_id: str,
                  keep_previous: bool) -> list[ReceiveResult]:
        if not replica_ids:
            raise InvalidArgument("replica_ids must not be empty", reason=Reason.EMPTY_REPLICA_IDS)
        if step not in STEPS:
            raise InvalidArgument(f"step must be one of {', '.join(STEPS)}", reason=Reason.INVALID_ARGUMENT)
        if step in ("CHECK", "INSTALL") and not path:
            raise InvalidArgument("checkpoint_path must name the checkpoint's directory", reason=Reason.INVALID_ARGUMENT)
        if version < 0:
            raise InvalidArgument(f"weight_version must be >= 0, got {version}", reason=Reason.INVALID_WEIGHT_VERSION)
        if not update_id and (keep_previous or step in ("RELEASE", "REVERT")):
            raise InvalidArgument(f"{step} {'with keep_previous ' if keep_previous else ''}needs an update_id",
                                  reason=Reason.INVALID_ARGUMENT)
        replicas = [self.manager.get(i) for i in replica_ids]   # NOT_FOUND before anything runs
        one = {"CHECK": self._check, "INSTALL": self._install, "RELEASE": self._release, "REVERT": self._revert}[step]
        return list(await asyncio.gather(*(one(r, path=path, version=version, update_id=update_id,
                                                keep_previous=keep_previous) for r in replicas)))

    # ------------------------------------------------------------ the steps
    async def _check(self, replica: Replica, *, path: str, version: int, update_id: str,
                     keep_previous: bool) -> ReceiveResult:
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._plan, replica, path, keep_previous)
        except Exception as err:   # noqa: BLE001 - the replica's failure is its result
            return _failed(replica, started, err)
        return ReceiveResult(replica.replica_id, replica.weight_version, True, 0, time.monotonic() - started)

    async def _install(self, replica: Replica, *, path: str, version: int, update_id: str,
                       keep_previous: bool) -> ReceiveResult:
        started = time.monotonic()
        try:
            plan = await asyncio.to_thread(self._plan, replica, path, keep_previous)
        except Exception as err:   # noqa: BLE001
            return _failed(replica, started, err)
        try:
            async with swapping_weights(replica) as weights_asleep:
                kept = None
                if keep_previous:
                    kept = _Kept(update_id, replica.weight_version,
                                 await asyncio.to_thread(_host_copy, replica.engine.named_weights()))
                tensors = await asyncio.to_thread(_read, plan)
                if weights_asleep:
                    await replica.engine.wake_up({"weights"})
                await replica.engine.load_weights(tensors, version)
                replica.weights_discarded = False
                if kept is not None:
                    self.kept[replica.replica_id] = kept
                else:
                    self.kept.pop(replica.replica_id, None)
        except Exception as err:   # noqa: BLE001 - load_weights changes nothing when it fails
            return _failed(replica, started, err)
        size = sum(_nbytes(t) for t in tensors.values())
        log.info("replica %s now serves weight version %d from checkpoint %s (%d bytes in %.3f s)",
                 replica.replica_id, version, path, size, time.monotonic() - started)
        return ReceiveResult(replica.replica_id, version, True, size, time.monotonic() - started)

    async def _release(self, replica: Replica, *, path: str, version: int, update_id: str,
                       keep_previous: bool) -> ReceiveResult:
        kept = self.kept.get(replica.replica_id)
        if kept is not None and kept.update_id == update_id:
            del self.kept[replica.replica_id]
        return ReceiveResult(replica.replica_id, replica.weight_version, True, 0, 0.0)

    async def _revert(self, replica: Replica, *, path: str, version: int, update_id: str,
                      keep_previous: bool) -> ReceiveResult:
        started = time.monotonic()
        kept = self.kept.get(replica.replica_id)
        if kept is None or kept.update_id != update_id:
            return _failed(replica, started, LookupError(f"no weights kept under update {update_id[:64]!r}"))
        try:
            async with swapping_weights(replica):
                await replica.engine.load_weights(kept.tensors, kept.version)
        except Exception as err:   # noqa: BLE001
            return _failed(replica, started, err)
        del self.kept[replica.replica_id]
        log.info("replica %s is back on weight version %d (update %s rolled back)", replica.replica_id,
                 kept.version, update_id)
        return ReceiveResult(replica.replica_id, kept.version, True, sum(_nbytes(t) for t in kept.tensors.values()),
                             time.monotonic() - started)

    # ------------------------------------------------------------ reading
    @staticmethod
    def _plan(replica: Replica, path: str, keep_previous: bool) -> dict[str, tuple[Path, WeightSpec]]:
        """Where each of the replica's weights is in the checkpoint; raises why the replica cannot load it."""
        if replica.state in _CANNOT_LOAD:
            raise RuntimeError(f"replica is {replica.state}")
        if replica.busy == "weights":
            raise RuntimeError("replica is already loading, receiving or sending weights")
        if keep_previous and not replica.awake:
            raise RuntimeError(f"replica is {replica.state}: its weights cannot be kept for a rollback")
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{path[:200]} is not a directory on this node")
        have, where = checkpoint_spec(root)
        by_name = {s.name: s for s in have}
        plan, wrong = {}, []
        for spec in replica.engine.weight_spec():
            found = by_name.get(spec.name)
            if found is None:
                wrong.append(f"{spec.name} is missing")
            elif tuple(found.shape) != tuple(spec.shape):
                wrong.append(f"{spec.name} has shape {list(found.shape)}, the model {list(spec.shape)}")
            elif found.dtype != spec.dtype and not (found.dtype in FLOAT_DTYPES and spec.dtype in FLOAT_DTYPES):
                wrong.append(f"{spec.name} is {found.dtype}, the model {spec.dtype}")
            else:
                plan[spec.name] = (where[spec.name], spec)
        if wrong:
            more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
            raise ValueError(f"checkpoint {path[:200]} does not fit the served model: {'; '.join(wrong[:3])}{more}")
        if keep_previous:
            iter(replica.engine.named_weights())   # EngineUnavailable when the engine cannot export them
        return plan


def _read(plan: Mapping[str, tuple[Path, WeightSpec]]) -> dict[str, Any]:
    """The planned tensors, in the served dtypes, each file opened once."""
    import torch  # noqa: PLC0415
    from safetensors import safe_open  # noqa: PLC0415

    by_file: dict[Path, list[WeightSpec]] = {}
    for file, spec in plan.values():
        by_file.setdefault(file, []).append(spec)
    out = {}
    for file, specs in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for spec in specs:
                tensor = f.get_tensor(spec.name)
                want = getattr(torch, spec.dtype)
                out[spec.name] = tensor if tensor.dtype == want else tensor.to(want)
    return out


def _host_copy(named: Any) -> dict[str, Any]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named}


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def _failed(replica: Replica, started: float, err: BaseException) -> ReceiveResult:
    why = str(err) or type(err).__name__
    log.warning("replica %s: checkpoint load step failed: %s", replica.replica_id, why)
    return ReceiveResult(replica.replica_id, replica.weight_version, False, 0, time.monotonic() - started, why[:500])
