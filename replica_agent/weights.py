"""Weight syncs on the replica side: decode a sync plan, receive or send over a process group.

Each replica is one member of the transfer group (``GroupCache`` per replica,
member id = replica id; rank 0, the sender, is ``plan.source``). The bytes
go through the shared bucketed transfer in :mod:`weight_transfer`, and
plans and manifests are decoded by :mod:`weight_transfer.wire`; this
module keeps the replicas' groups and records results per ``sync_id`` so a
repeated call returns them instead of transferring twice.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from weight_transfer import GroupCache, Manifest, WeightTransferConfig
from weight_transfer.wire import (  # noqa: F401 - the plan/manifest wire helpers, shared with the trainer
    BACKENDS,
    SyncPlan,
    manifest_from_proto,
    manifest_to_proto,
    plan_from_proto,
)

_RECORDED_SYNCS = 256


@dataclasses.dataclass
class ReceiveResult:
    replica_id: str
    weight_version: int
    checksum_ok: bool
    bytes_received: int
    duration_s: float
    error: str = ""
    delta_base_missing: bool = False
    """The plan was a delta and this replica did not serve its base: it needs a full copy."""


@dataclasses.dataclass
class SendResult:
    bytes_sent: int
    duration_s: float
    checksum: str
    weight_version: int


@dataclasses.dataclass(frozen=True)
class PreparedSource:
    """A replica's weights laid out as the source of a seed-replica sync."""

    replica_id: str
    weight_version: int
    manifest: Manifest
    rendezvous: tuple[str, int]


class WeightGroups:
    """Process groups of this node's replicas (one cache per replica) and recorded syncs."""

    def __init__(self, config: WeightTransferConfig) -> None:
        self.config = config
        self._caches: dict[str, GroupCache] = {}
        self.results: OrderedDict[tuple[str, str], ReceiveResult] = OrderedDict()
        self.ports: dict[str, int] = {}
        """Replica id -> port of the rendezvous store it hosts as a sync source (kept for its life)."""
        self.prepared: dict[str, tuple[tuple[int, int, str], PreparedSource]] = {}
        """Replica id -> ((version, bucket size, algorithm), its last preparation as a source)."""

    def cache(self, member: str) -> GroupCache:
        cache = self._caches.get(member)
        if cache is None:
            cache = self._caches[member] = GroupCache(member, self.config)
        return cache

    def record(self, sync_id: str, member: str, result: ReceiveResult) -> None:
        self.results[(sync_id, member)] = result
        while len(self.results) > _RECORDED_SYNCS:
            self.results.popitem(last=False)

    def forget(self, member: str) -> None:
        """Drop a replica's preparation (its weights changed or it stopped)."""
        self.prepared.pop(member, None)

    def close(self) -> None:
        for cache in self._caches.values():
            cache.close()
        self._caches.clear()
        self.ports.clear()
        self.prepared.clear()
