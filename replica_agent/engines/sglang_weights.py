"""The weight update group an SGLang server joins, and the broadcast of one update over it.

SGLang receives new weights from a trainer-side process through
``/init_weights_update_group`` (``master_address``, ``master_port``,
``rank_offset``, ``world_size``, ``group_name``, ``backend``): each of its
tensor-parallel workers joins a torch process group at rank
``rank_offset + tp_rank``, rendezvousing on a ``TCPStore`` that rank 0 hosts,
under a ``PrefixStore(group_name)`` (SGLang's ``init_custom_process_group``).
``/update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
``group_name``, ``flush_cache``) then makes every worker receive each named
tensor, in order, by ``broadcast`` from rank 0 and load it under its Hugging
Face name. Here the replica agent is rank 0: it joins the group the same way
and broadcasts the tensors rollmesh's weight sync delivered to it.
"""

from __future__ import annotations

import datetime
import logging
import math
import uuid
from typing import Any

from mesh_runtime.net import free_port
from mesh_runtime.reasons import Reason

from .errors import EngineError

log = logging.getLogger(__name__)


class WeightUpdateGroup:
    """Rank 0 of one update group shared with an SGLang server (``world_size = 1 + tp_size``)."""

    def __init__(self, *, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.world_size = world_size
        self.backend = backend
        self.group_name = f"rollmesh-{uuid.uuid4().hex[:12]}"
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._group: Any = None

    def request(self) -> dict[str, Any]:
        """The body of ``/init_weights_update_group`` that makes the server join this group."""
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend}

    def join(self) -> None:
        """Host the rendezvous store and join as rank 0 (blocks until every server worker has joined)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _new_process_group_helper

        self._store = dist.TCPStore(self.host, self.port, self.world_size, is_master=True, timeout=self.timeout,
                                    wait_for_workers=False)
        self._group, _ = _new_process_group_helper(
            self.world_size, 0, [], self.backend, dist.PrefixStore(self.group_name, self._store),
            group_name=self.group_name, timeout=self.timeout)  # type: ignore[arg-type]  # GroupName: a str

    def broadcast(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Send each tensor, in the order ``/update_weights_from_distributed`` names them."""
        import torch
        import torch.distributed as dist

        if self._group is None:
            raise EngineError("the weight update group is not joined", reason=Reason.WEIGHT_GROUP_MISSING)
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        for _name, tensor in named_tensors:
            data = tensor.detach()
            data = data.to(device) if device is not None else data.cpu()
            dist.broadcast(data.contiguous(), group=self._group, group_src=0)   # no default group here

    def close(self) -> None:
        import torch.distributed as dist

        group, self._group, self._store = self._group, None, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - closing must not fail
                log.debug("destroying weight update group failed", exc_info=True)


def update_request(bucket: list[tuple[str, Any]], group_name: str, *, flush_cache: bool) -> dict[str, Any]:
    """The body of ``/update_weights_from_distributed`` for one bucket."""
    return {"names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": group_name, "flush_cache": flush_cache}


def weight_bytes(spec: list[Any]) -> int:
    """Bytes of the weights a spec (``WeightSpec`` list) describes: what releasing them frees on the device."""
    import torch

    return sum(math.prod(entry.shape) * getattr(torch, entry.dtype).itemsize for entry in spec)
