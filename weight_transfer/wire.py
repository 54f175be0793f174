"""Weight-sync messages on the wire: ``WeightSyncPlan`` and ``WeightManifest`` to and from Python.

Both ends of a broadcast decode the same plan: the sender (the trainer agent,
or a replica agent seeding new replicas) and every receiver. Decoding checks
everything a participant needs before it touches a process group and raises
:class:`~mesh_runtime.errors.InvalidArgument` (reason ``INVALID_SYNC_PLAN``,
or ``WEIGHT_MANIFEST_INVALID`` for a manifest with an impossible layout)
naming what is malformed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import weights_pb2

from .errors import InvalidManifest
from .manifest import Manifest, TensorEntry

BACKENDS = {weights_pb2.PROCESS_GROUP_BACKEND_GLOO: "gloo", weights_pb2.PROCESS_GROUP_BACKEND_NCCL: "nccl"}
"""``ProcessGroupBackend`` value -> backend name used by :class:`~weight_transfer.GroupCache`."""


@dataclasses.dataclass(frozen=True)
class DeltaPlan:
    """A validated ``WeightDelta``."""

    base_version: int
    base_checksum: str
    stream: Manifest
    changed_words: int = 0
    total_words: int = 0


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """A validated ``WeightSyncPlan``."""

    sync_id: str
    weight_version: int
    group_id: str
    rendezvous: tuple[str, int]
    backend: str
    manifest: Manifest
    timeout_s: float
    source: str
    members: tuple[str, ...]
    """Member ids by rank: ``members[0]`` is the sender (``source``), the rest are replica ids."""
    sync_key: bytes = dataclasses.field(default=b"", repr=False)
    """The per-sync secret (empty: unauthenticated); never printed."""
    delta: DeltaPlan | None = None
    """Set: the stream is a delta from a base version the receivers hold (:mod:`weight_transfer.delta`)."""

    @property
    def stream(self) -> Manifest:
        """The manifest of what travels: the delta stream, or the full weights."""
        return self.delta.stream if self.delta is not None else self.manifest

    def rank_of(self, member: str) -> int | None:
        return self.members.index(member) if member in self.members else None


def manifest_from_proto(msg: weights_pb2.WeightManifest) -> Manifest:
    """Decode a manifest and check its layout (:class:`~weight_transfer.InvalidManifest` if impossible)."""
    manifest = Manifest(tensors=tuple(TensorEntry(name=t.name, dtype=t.dtype, shape=tuple(t.shape),
                                                  bucket_index=t.bucket_index, offset_bytes=t.offset_bytes,
                                                  nbytes=t.nbytes) for t in msg.tensors),
                        bucket_size_bytes=msg.bucket_size_bytes, total_bytes=msg.total_bytes,
                        checksum=msg.checksum, checksum_algorithm=msg.checksum_algorithm,
                        bucket_digests=tuple(msg.bucket_digests))
    manifest.check_layout()
    return manifest


def manifest_to_proto(manifest: Manifest) -> weights_pb2.WeightManifest:
    return weights_pb2.WeightManifest(
        tensors=[weights_pb2.TensorSpec(name=e.name, dtype=e.dtype, shape=e.shape, bucket_index=e.bucket_index,
                                        offset_bytes=e.offset_bytes, nbytes=e.nbytes) for e in manifest.tensors],
        bucket_size_bytes=manifest.bucket_size_bytes, total_bytes=manifest.total_bytes,
        checksum=manifest.checksum, checksum_algorithm=manifest.checksum_algorithm,
        bucket_digests=list(manifest.bucket_digests))


def plan_from_proto(msg: weights_pb2.WeightSyncPlan, default_timeout_s: float) -> SyncPlan:
    """Validate a plan from the wire; ``InvalidArgument`` names what is malformed.

    ``default_timeout_s`` applies when the plan sets no timeout. Rank 0's
    member id is ``plan.source`` (its ``replica_id`` is not used).
    """
    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"malformed weight sync plan {msg.sync_id or '(no sync_id)'}: {why}",
                               reason=Reason.INVALID_SYNC_PLAN)

    if not msg.sync_id:
        raise bad("sync_id is empty")
    if not msg.rendezvous_host or not 0 < msg.rendezvous_port < 65536:
        raise bad("rendezvous_host and a rendezvous_port in 1..65535 are required")
    if msg.backend not in BACKENDS:
        raise bad("backend must be PROCESS_GROUP_BACKEND_GLOO or PROCESS_GROUP_BACKEND_NCCL")
    ranks = sorted(m.rank for m in msg.members)
    if msg.world_size < 2 or len(msg.members) != msg.world_size or ranks != list(range(msg.world_size)):
        raise bad(f"members must hold ranks 0..{msg.world_size - 1} exactly once (world_size "
                  f"{msg.world_size}, ranks {ranks})")
    by_rank = {m.rank: m for m in msg.members}
    members = [msg.source or "sender"] + [by_rank[r].replica_id for r in range(1, msg.world_size)]
    if any(not m for m in members[1:]) or len(set(members)) != len(members):
        raise bad("every receiving member needs a distinct replica_id, different from the source")
    if not msg.group_id:
        raise bad("group_id is empty")
    if msg.sync_key and len(msg.sync_key) != 32:
        raise bad(f"sync_key must be 32 bytes, got {len(msg.sync_key)}")
    timeout = msg.timeout.ToNanoseconds() / 1e9 if msg.timeout.ByteSize() else default_timeout_s
    if timeout <= 0:
        raise bad(f"timeout must be positive, got {timeout} s")
    manifest = manifest_from_proto(msg.manifest)
    delta = delta_from_proto(msg.delta, manifest, bad) if msg.HasField("delta") else None
    return SyncPlan(sync_id=msg.sync_id, weight_version=msg.weight_version, group_id=msg.group_id,
                    rendezvous=(msg.rendezvous_host, msg.rendezvous_port), backend=BACKENDS[msg.backend],
                    manifest=manifest, timeout_s=timeout, source=members[0],
                    members=tuple(members), sync_key=bytes(msg.sync_key), delta=delta)


def delta_from_proto(msg: weights_pb2.WeightDelta, target: Manifest,
                     bad: Callable[[str], InvalidArgument]) -> DeltaPlan:
    """Decode a plan's delta and check its stream names buckets of ``target`` in a usable order."""
    from .delta import delta_entries  # noqa: PLC0415 - torch only when a delta is decoded

    if msg.base_version < 0 or not msg.base_checksum:
        raise bad("delta needs base_version >= 0 and a base_checksum")
    stream = manifest_from_proto(msg.stream)
    try:
        delta_entries(stream, target)
    except InvalidManifest as err:
        raise bad(f"delta: {err}") from None
    return DeltaPlan(base_version=msg.base_version, base_checksum=msg.base_checksum, stream=stream,
                     changed_words=msg.changed_words, total_words=msg.total_words)


def delta_to_proto(delta: DeltaPlan) -> weights_pb2.WeightDelta:
    return weights_pb2.WeightDelta(base_version=delta.base_version, base_checksum=delta.base_checksum,
                                   stream=manifest_to_proto(delta.stream), changed_words=delta.changed_words,
                                   total_words=delta.total_words)
