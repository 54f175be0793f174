"""Weights from a trainer's own process group, as SGLang's ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/destroy_weights_update_group`` take them: the agent's part of the
controller's ``UpdateWeightsFromGroup``.

A replica joins the trainer's group the way an SGLang engine does (a client of the TCP store the trainer's
rank 0 hosts, the group's keys under its name, torch's process-group helper), so a trainer that drives SGLang
engines this way drives rollmesh replicas unchanged. It then receives the tensors rank 0 broadcasts, in the
order the call lists them, and loads them (a subset of its weights is fine) while the replica is SYNCING. torch
names a process group once per process: one replica of a node at a time in a group of a given name.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

from mesh_runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from mesh_runtime.reasons import Reason

from .engines.types import WeightSpec
from .replicas import ReplicaManager
from .syncing import swapping_weights
from .weights import ReceiveResult

log = logging.getLogger(__name__)
_CAN_JOIN = ("ACTIVE", "PAUSED", "SLEEPING")


@dataclass
class _Joined:
    replica_id: str
    group: Any
    backend: str


class GroupWeights:
    """The trainer groups this node's replicas joined, by group name."""

    def __init__(self, manager: ReplicaManager, timeout_s: float) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self.joined: dict[str, _Joined] = {}

    async def join(self, replica_id: str, *, host: str, port: int, rank: int, world_size: int, group_name: str,
                   backend: str, timeout_s: float | None) -> None:
        if not host or not 0 < port < 65536:
            raise InvalidArgument("master_address and master_port must name the trainer's TCP store",
                                  reason=Reason.INVALID_ADDRESS)
        if not 0 < rank < world_size:
            raise InvalidArgument(f"rank must be 1 .. world_size - 1 (rank 0 is the trainer's); got rank {rank} "
                                  f"of {world_size}", reason=Reason.INVALID_ARGUMENT)
        if not group_name or len(group_name) > 200:
            raise InvalidArgument("group_name must be 1 to 200 characters", reason=Reason.INVALID_ARGUMENT)
        if backend not in ("gloo", "nccl"):
            raise InvalidArgument("backend must be gloo or nccl", reason=Reason.INVALID_ARGUMENT)
        replica = self.manager.get(replica_id)
        if replica.state not in _CAN_JOIN:
            raise FailedPrecondition(f"replica {replica_id!r} is {replica.state} and cannot take weights",
                                     reason=Reason.WRONG_REPLICA_STATE)
        if group_name in self.joined:
            raise AlreadyExists(f"replica {self.joined[group_name].replica_id!r} of this node is in group "
                                f"{group_name[:64]!r} already (one replica of a node per group)",
                                reason=Reason.ALREADY_EXISTS)
        self.joined[group_name] = _Joined(replica_id, None, backend)   # held while the group comes up
        try:
            group = await asyncio.to_thread(_join, host, port, rank, world_size, group_name, backend,
                                            timeout_s or self.timeout_s)
        except BaseException:
            del self.joined[group_name]
            raise
        self.joined[group_name].group = group
        log.info("replica %s joined group %s as rank %d of %d (%s, store %s:%d)", replica_id, group_name, rank,
                 world_size, backend, host, port)

    async def receive(self, replica_id: str, group_name: str, tensors: list[WeightSpec], version: int | None,
                      timeout_s: float | None) -> ReceiveResult:
        replica = self.manager.get(replica_id)
        joined = self.joined.get(group_name)
        if joined is None or joined.replica_id != replica_id or joined.group is None:
            raise NotFound(f"replica {replica_id!r} is in no group {group_name[:64]!r}", reason=Reason.WEIGHT_GROUP_MISSING)
        if not tensors:
            raise InvalidArgument("tensors must list what rank 0 broadcasts", reason=Reason.INVALID_ARGUMENT)
        if version is not None and version < 0:
            raise InvalidArgument(f"weight_version must be >= 0, got {version}", reason=Reason.INVALID_WEIGHT_VERSION)
        spec = {s.name: s for s in replica.engine.weight_spec()}
        wrong = []
        for t in tensors:
            have = spec.get(t.name)
            if have is None:
                wrong.append(t.name)
            elif (t.dtype, tuple(t.shape)) != (have.dtype, tuple(have.shape)):
                wrong.append(f"{t.name} {t.dtype}{list(t.shape)} is {have.dtype}{list(have.shape)} here")
        if wrong:
            raise InvalidArgument(f"tensors the replica does not have as listed: {', '.join(wrong[:3])[:300]}",
                                  reason=Reason.INVALID_ARGUMENT)
        started = time.monotonic()
        try:
            async with swapping_weights(replica) as weights_asleep:
                received = await asyncio.to_thread(_receive, joined.group, joined.backend, tensors,
                                                   timeout_s or self.timeout_s)
                if weights_asleep:
                    await replica.engine.wake_up({"weights"})
                await replica.engine.load_weights(received, replica.weight_version if version is None else version)
                replica.weights_discarded = False
        except Exception as err:   # noqa: BLE001 - the replica's failure is its result
            why = str(err) or type(err).__name__
            log.warning("replica %s: receiving from group %s failed: %s", replica_id, group_name, why)
            return ReceiveResult(replica_id, replica.weight_version, False, 0, time.monotonic() - started, why[:500])
        size = sum(int(t.numel() * t.element_size()) for t in received.values())
        return ReceiveResult(replica_id, replica.weight_version, True, size, time.monotonic() - started)

    def leave(self, replica_id: str, group_name: str) -> bool:
        self.manager.get(replica_id)
        joined = self.joined.get(group_name)
        if joined is None or joined.replica_id != replica_id or joined.group is None:
            return False
        del self.joined[group_name]
        _destroy(joined.group)
        return True

    def close(self) -> None:
        for joined in self.joined.values():
            if joined.group is not None:
                _destroy(joined.group)
        self.joined.clear()


def _join(host: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
          timeout_s: float) -> Any:
    """The group as an SGLang engine builds it (``init_custom_process_group``)."""
    import torch.distributed as dist  # noqa: PLC0415 - torch only when weights move
    from torch.distributed.distributed_c10d import _new_process_group_helper  # noqa: PLC0415

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, False, timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                         group_name=cast(Any, group_name), timeout=timeout)
    return group


def _receive(group: Any, backend: str, tensors: list[WeightSpec], timeout_s: float) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    out = {}
    for spec in tensors:
        tensor = torch.empty(tuple(spec.shape), dtype=getattr(torch, spec.dtype), device=device)
        work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
        if work is not None and not work.wait(datetime.timedelta(seconds=timeout_s)):
            raise TimeoutError(f"rank 0 did not send {spec.name} within {timeout_s:g} s")
        out[spec.name] = tensor
    return out


def _destroy(group: Any) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    try:
        dist.destroy_process_group(group)
    except Exception as err:  # noqa: BLE001 - a group whose peer has gone may not destroy cleanly
        log.warning("destroying a trainer group failed: %s", err)
