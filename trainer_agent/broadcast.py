"""The trainer's side of a weight sync: prepare one version, then send it as rank 0.

The controller drives a sync in two calls to this trainer:

1. ``PrepareWeightSync`` -> :meth:`WeightBroadcaster.prepare`: a frozen
   :class:`~.weight_source.WeightSnapshot` of the version, its manifest
   (:func:`~weight_transfer.build_manifest`), and the rendezvous store,
   hosted once at start on the configured ``weight_rendezvous``. The answer is
   what the controller copies into the plan.
2. ``SendWeights`` -> :meth:`WeightBroadcaster.send`, concurrently with every
   receiver's ``ReceiveWeights``: the plan must name this trainer as source
   and carry the prepared version and manifest; the group comes from the
   :class:`~weight_transfer.GroupCache` (built once per member set and
   group id, then reused) and the bytes go out with
   :func:`~weight_transfer.send_weights_async`.

Until a training loop runs here, nothing moves the version on; with
``adopt_newer_versions`` a prepare for a newer version publishes the current
weights under it, so the controller's step numbers become the versions.

One broadcast runs at a time. The prepared snapshot stays until a newer
prepare replaces it (or :meth:`release` drops it), so several syncs of one
version (standalone replicas, then hybrid ones, then scaled-out ones) reuse
it without copying or hashing the weights again.

Delta versions (``weight_transfer.delta_max_ratio`` > 0): when a newer
version is prepared, the one before stays as the *base*, what the fleet
holds. A prepare that names that base (``delta_base_version``) also encodes
the new version as a delta from it (:mod:`weight_transfer.delta`), once per
version, and a plan carrying that delta sends the delta stream instead of the
weights. Keeping the base costs one more copy of the weights in the served
dtype, in host memory (a GPU trainer copies the previous snapshot out once
per version; the encoder moves it back a bucket at a time);
``delta_max_ratio: 0`` turns deltas off and keeps none. The deltas of the last
``delta_history`` versions are kept too (host memory, at most one model's
bytes): a prepare that names an older base gets them composed into one delta
(:func:`weight_transfer.delta.compose_deltas`), for a replica that missed
versions.

``served_dtype`` (the trainer agent's ``served_dtype``): floating-point
weights are cast to it when a version is prepared, so a trainer that keeps
float32 weights broadcasts what bf16 replicas serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict

import torch
from opentelemetry import trace
from opentelemetry.trace import Tracer

from mesh_runtime.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument
from mesh_runtime.net import format_host_port
from mesh_runtime.reasons import Reason
from weight_transfer import (
    CHECKSUM_ALGORITHMS,
    GroupCache,
    Manifest,
    TransferTimeout,
    WeightTransferConfig,
    build_manifest,
    send_weights_async,
)
from weight_transfer.delta import Delta, compose_deltas, encode_delta, same_layout
from weight_transfer.wire import SyncPlan

from .weight_source import WeightSnapshot, WeightSource

log = logging.getLogger(__name__)

_RECORDED_SYNCS = 256


@dataclasses.dataclass(frozen=True)
class PreparedSync:
    """A version fixed for broadcasting: its frozen tensors and their manifest."""

    snapshot: WeightSnapshot
    manifest: Manifest
    deltas: dict[int, Delta | None] = dataclasses.field(default_factory=dict, compare=False)
    """Base version -> this version as a delta from it (None: a full copy is cheaper), computed on request."""

    @property
    def weight_version(self) -> int:
        return self.snapshot.weight_version

    def serves(self, weight_version: int, bucket_size_bytes: int, checksum_algorithm: str) -> bool:
        return (self.weight_version, self.manifest.bucket_size_bytes, self.manifest.checksum_algorithm) == (
            weight_version, bucket_size_bytes, checksum_algorithm)


@dataclasses.dataclass(frozen=True)
class SendResult:
    """What one broadcast sent."""

    bytes_sent: int
    duration_s: float
    checksum: str
    weight_version: int
    group_reused: bool = False
    """Whether the process group was already built by an earlier sync to the same member set."""


def _first_difference(ours: Manifest, theirs: Manifest) -> str:
    """Where two manifests part, in a few words (for error messages)."""
    for what in ("bucket_size_bytes", "total_bytes", "checksum_algorithm", "checksum"):
        if getattr(ours, what) != getattr(theirs, what):
            return f"{what} is {getattr(theirs, what)!r}, prepared {getattr(ours, what)!r}"
    if len(ours.tensors) != len(theirs.tensors):
        return f"{len(theirs.tensors)} tensors, prepared {len(ours.tensors)}"
    for mine, other in zip(ours.tensors, theirs.tensors):
        if mine != other:
            return f"tensor {other.name!r} differs from prepared {mine.name!r}"
    return "no difference"


def _on_host(prepared: PreparedSync) -> PreparedSync:
    """``prepared`` with its tensors in host memory (a delta base must not hold accelerator memory)."""
    if all(t.device.type == "cpu" for _, t in prepared.snapshot.tensors):
        return prepared
    tensors = tuple((name, t.to("cpu")) for name, t in prepared.snapshot.tensors)
    return dataclasses.replace(prepared, snapshot=dataclasses.replace(prepared.snapshot, tensors=tensors))


class WeightBroadcaster:
    """Prepares and sends this trainer's weights; owns its rendezvous store and its process groups."""

    def __init__(self, source: WeightSource, *, member_id: str, rendezvous: tuple[str, int],
                 config: WeightTransferConfig, tracer: Tracer | None = None,
                 adopt_newer_versions: bool = False, served_dtype: str = "") -> None:
        self.source = source
        self.member_id = member_id
        self.adopt_newer_versions = adopt_newer_versions
        """Prepare publishes the current weights under a requested newer version (no training loop owns them)."""
        self.config = config
        self.tracer = tracer
        self._host, self._port = rendezvous
        self._cache: GroupCache | None = None
        self._prepared: PreparedSync | None = None
        self._base: PreparedSync | None = None
        """The version prepared before the current one: the base of its delta."""
        self._history: list[tuple[int, Delta]] = []
        """(version, its delta from the version before), consecutive, newest last, in host memory: what an
        older base's delta is composed of."""
        self.served_dtype = getattr(torch, served_dtype) if served_dtype else None
        self._prepare_lock = asyncio.Lock()
        self._active: tuple[str, asyncio.Task] | None = None
        self._results: OrderedDict[str, SendResult] = OrderedDict()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Host the rendezvous store (port 0 picks a free port, kept for the life of the process)."""
        if self._cache is None:
            self._cache = GroupCache(self.member_id, self.config)
        self._port = await asyncio.to_thread(self._cache.host_rendezvous, self._host, self._port)
        log.info("weight broadcasts from %s rendezvous at %s", self.member_id, self.rendezvous_address)

    async def close(self) -> None:
        """Close every process group and the store. Idempotent."""
        if self._active is not None:
            self._active[1].cancel()
        cache, self._cache = self._cache, None
        if cache is not None:
            await asyncio.to_thread(cache.close)
        self._prepared = self._base = None
        self._history.clear()

    @property
    def rendezvous(self) -> tuple[str, int] | None:
        """``(host, port)`` receivers connect to; None until :meth:`start`."""
        return (self._host, self._port) if self._cache is not None and self._port else None

    @property
    def rendezvous_address(self) -> str:
        return format_host_port(*self.rendezvous) if self.rendezvous else ""

    @property
    def groups_built(self) -> int:
        """Process groups built so far: a sync to a member set already synced builds none."""
        return self._cache.constructions if self._cache is not None else 0

    @property
    def prepared(self) -> PreparedSync | None:
        return self._prepared

    def release(self) -> bool:
        """Drop the prepared snapshot (e.g. to free accelerator memory) unless a send is running."""
        if self._active is not None or self._prepared is None:
            return False
        self._prepared = self._base = None
        self._history.clear()
        return True

    # -- PrepareWeightSync ---------------------------------------------------------------------

    async def prepare(self, weight_version: int = 0, bucket_size_bytes: int | None = None,
                      checksum_algorithm: str | None = None, delta_base_version: int = 0) -> PreparedSync:
        """Fix ``weight_version`` (0 = current) for broadcasting; repeat calls return the same preparation.

        With ``delta_base_version``, also encode the version as a delta from
        that one where this trainer still holds it (``prepared.deltas``).
        """
        bucket = self.config.bucket_size_bytes if bucket_size_bytes is None else bucket_size_bytes
        algorithm = checksum_algorithm or self.config.checksum_algorithm
        if weight_version < 0:
            raise InvalidArgument(f"weight_version must be >= 0 (0 = current), got {weight_version}",
                                  reason=Reason.INVALID_WEIGHT_VERSION)
        if bucket <= 0:
            raise InvalidArgument("bucket_size_bytes must be positive when set", reason=Reason.INVALID_BUCKET_SIZE)
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise InvalidArgument(f"checksum_algorithm {algorithm!r} is not one of {list(CHECKSUM_ALGORITHMS)}",
                                  reason=Reason.INVALID_CHECKSUM_ALGORITHM)
        cache = self._check_started()
        async with self._prepare_lock:
            prepared = self._prepared
            wanted = weight_version or self.source.weight_version
            if prepared is not None and prepared.serves(wanted, bucket, algorithm):
                await self._prepare_delta(prepared, delta_base_version)
                return prepared
            if self.adopt_newer_versions and weight_version > self.source.weight_version + 1:
                raise FailedPrecondition(
                    f"weight version {weight_version} jumps from the trainer's {self.source.weight_version} "
                    f"without a sync in between: without a training loop only the next version "
                    f"({self.source.weight_version + 1}) is adopted", reason=Reason.VERSION_JUMP)
            if self.adopt_newer_versions and weight_version > self.source.weight_version:
                log.info("no training loop publishes versions here: the current weights (version %d) become "
                         "version %d", self.source.weight_version, weight_version)
                await asyncio.to_thread(self._adopt, weight_version)
            prepared = await asyncio.to_thread(self._build_prepared, weight_version, bucket, algorithm)
            # The store is up since start(); asking again is free and restarts nothing.
            await asyncio.to_thread(cache.host_rendezvous, self._host, self._port)
            previous = self._prepared
            if self.config.delta_max_ratio > 0 and previous is not None:
                if previous.weight_version != prepared.weight_version:
                    # what the fleet was sent: the next delta's base, kept in host memory
                    self._base = await asyncio.to_thread(_on_host, previous)
            else:
                self._base = None
            self._prepared = prepared
            await self._prepare_delta(prepared, delta_base_version)
        log.info("prepared weight version %d: %d tensors, %d bytes in %d buckets, %s %s",
                 prepared.weight_version, len(prepared.manifest.tensors), prepared.manifest.total_bytes,
                 prepared.manifest.num_buckets, algorithm, prepared.manifest.checksum)
        return prepared

    def _adopt(self, weight_version: int) -> None:
        with self.source.updating(weight_version):
            pass  # the weights stay as they are; only their version moves on

    def _build_prepared(self, weight_version: int, bucket: int, algorithm: str) -> PreparedSync:
        snapshot = self.source.snapshot(weight_version)
        served = self.served_dtype
        if served is not None:
            snapshot = dataclasses.replace(snapshot, tensors=tuple(
                (name, t.to(served) if t.is_floating_point() and t.dtype != served else t)
                for name, t in snapshot.tensors))
        manifest = build_manifest(snapshot.tensors, bucket, checksum_algorithm=algorithm)
        return PreparedSync(snapshot, manifest)

    async def _prepare_delta(self, prepared: PreparedSync, base_version: int) -> None:
        """Encode ``prepared`` as a delta from ``base_version`` once, if this trainer holds that base (the
        version before) or the deltas since it (an older one: :meth:`_compose`)."""
        base = self._base
        if (not base_version or base_version in prepared.deltas or base is None
                or self.config.delta_max_ratio <= 0 or not same_layout(base.manifest, prepared.manifest)):
            return
        if base_version < base.weight_version:
            await self._compose(prepared, base_version)
            return
        if base.weight_version != base_version:
            return
        started = time.monotonic()
        device = prepared.snapshot.tensors[0][1].device if prepared.snapshot.tensors else "cpu"
        delta = await asyncio.to_thread(
            encode_delta, base.manifest, iter(base.snapshot.tensors), prepared.manifest,
            iter(prepared.snapshot.tensors), base_version=base_version, device=device,
            bucket_ratio=self.config.delta_bucket_ratio, max_ratio=self.config.delta_max_ratio)
        prepared.deltas[base_version] = delta
        self._record(prepared.weight_version, delta)
        if delta is None:
            log.info("weight version %d from %d: the delta would exceed %.0f%% of the full %d bytes; receivers "
                     "at %d get full copies", prepared.weight_version, base_version,
                     100 * self.config.delta_max_ratio, prepared.manifest.total_bytes, base_version)
            return
        stats = delta.stats
        log.info("weight version %d as a delta from %d: %.2f%% of the words changed, %d of %d bytes (%.1f%%; "
                 "%d sparse, %d whole, %d unchanged buckets) in %.3f s", prepared.weight_version, base_version,
                 100 * stats.density, stats.bytes, stats.full_bytes, 100 * stats.ratio, stats.sparse_buckets,
                 stats.full_buckets, stats.unchanged_buckets, time.monotonic() - started)

    def _record(self, version: int, delta: Delta | None) -> None:
        """Keep ``version``'s delta from the version before (host memory; at most ``delta_history`` of them and
        one model's bytes), or forget them all when there is none (older bases then get full copies)."""
        if delta is None or not self.config.delta_history:
            self._history.clear()
            return
        if self._history and self._history[-1][0] != delta.base_version:
            self._history.clear()
        on_host = tuple((name, t.to("cpu")) for name, t in delta.tensors)
        self._history.append((version, dataclasses.replace(delta, tensors=on_host)))
        limit = delta.stats.full_bytes
        while len(self._history) > self.config.delta_history or (
                len(self._history) > 1 and sum(d.stats.bytes for _, d in self._history) > limit):
            self._history.pop(0)

    async def _compose(self, prepared: PreparedSync, base_version: int) -> None:
        """``prepared`` as a delta from an older ``base_version``: the kept deltas since it, composed
        (:func:`~weight_transfer.delta.compose_deltas`); none when they do not reach back that far."""
        base = self._base
        assert base is not None
        await self._prepare_delta(prepared, base.weight_version)   # the newest link, recorded
        versions = [v for v, _ in self._history]
        chain = [d for v, d in self._history if v > base_version]
        if (not versions or versions[-1] != prepared.weight_version or not chain
                or chain[0].base_version != base_version):
            return
        started = time.monotonic()
        device = prepared.snapshot.tensors[0][1].device if prepared.snapshot.tensors else "cpu"
        delta = await asyncio.to_thread(
            compose_deltas, chain, prepared.manifest, iter(prepared.snapshot.tensors), device=device,
            bucket_ratio=self.config.delta_bucket_ratio, max_ratio=self.config.delta_max_ratio)
        prepared.deltas[base_version] = delta
        if delta is not None:
            log.info("weight version %d from %d, composed of %d deltas: %.2f%% of the words changed, %d bytes "
                     "(%.1f%%) in %.3f s", prepared.weight_version, base_version, len(chain),
                     100 * delta.stats.density, delta.stats.bytes, 100 * delta.stats.ratio,
                     time.monotonic() - started)

    # -- SendWeights ---------------------------------------------------------------------------

    async def send(self, plan: SyncPlan) -> SendResult:
        """Broadcast the prepared weights as rank 0 of ``plan``; every check runs before any byte moves."""
        recorded = self._results.get(plan.sync_id)
        if recorded is not None:
            return recorded
        if self._active is not None:
            sync_id, task = self._active
            if sync_id == plan.sync_id:
                return await asyncio.shield(task)
            raise Aborted(f"weight broadcast {sync_id!r} is in progress; the trainer sends one at a time",
                          reason=Reason.TRANSFER_IN_PROGRESS, metadata={"sync_id": sync_id})
        cache = self._check_started()
        prepared = self._check_plan(plan)
        task = asyncio.ensure_future(self._transfer(cache, plan, prepared))
        self._active = (plan.sync_id, task)
        try:
            return await task  # cancelling this call cancels the transfer
        finally:
            self._active = None

    def _check_plan(self, plan: SyncPlan) -> PreparedSync:
        prepared = self._prepared
        if plan.source != self.member_id:
            raise FailedPrecondition(f"plan {plan.sync_id} is sourced from {plan.source!r}; this trainer sends as "
                                     f"{self.member_id!r} (use the source PrepareWeightSync returned)",
                                     reason=Reason.NOT_PLAN_SOURCE)
        if prepared is None:
            raise FailedPrecondition(f"no weights are prepared for plan {plan.sync_id}; call PrepareWeightSync "
                                     f"for weight version {plan.weight_version} first", reason=Reason.NOT_PREPARED)
        if plan.weight_version != prepared.weight_version:
            raise FailedPrecondition(f"plan {plan.sync_id} carries weight version {plan.weight_version} but version "
                                     f"{prepared.weight_version} is prepared; call PrepareWeightSync for "
                                     f"{plan.weight_version} or build the plan from its answer",
                                     reason=Reason.VERSION_MISMATCH,
                                     metadata={"prepared_version": prepared.weight_version})
        if plan.manifest != prepared.manifest:
            difference = _first_difference(prepared.manifest, plan.manifest)
            raise FailedPrecondition(f"the manifest of plan {plan.sync_id} is not the one prepared for version "
                                     f"{prepared.weight_version} ({difference}); copy the manifest "
                                     "PrepareWeightSync returned", reason=Reason.MANIFEST_MISMATCH)
        if plan.delta is not None:
            delta = prepared.deltas.get(plan.delta.base_version)
            if delta is None or delta.manifest != plan.delta.stream or delta.base_checksum != plan.delta.base_checksum:
                raise FailedPrecondition(f"plan {plan.sync_id} carries a delta from weight version "
                                         f"{plan.delta.base_version} that this trainer did not prepare; ask "
                                         "PrepareWeightSync with delta_base_version and copy its delta",
                                         reason=Reason.MANIFEST_MISMATCH)
        if plan.rendezvous[1] != self._port:
            raise FailedPrecondition(f"plan {plan.sync_id} points receivers at port {plan.rendezvous[1]}, but this "
                                     f"trainer's rendezvous store listens at {self.rendezvous_address}",
                                     reason=Reason.RENDEZVOUS_MISMATCH)
        return prepared

    async def _transfer(self, cache: GroupCache, plan: SyncPlan, prepared: PreparedSync) -> SendResult:
        started = time.monotonic()
        attributes: dict[str, str | int] = {"rollmesh.sync_id": plan.sync_id, "rollmesh.weight_version": plan.weight_version,
                      "rollmesh.group_id": plan.group_id, "rollmesh.world_size": len(plan.members),
                      "rollmesh.backend": plan.backend, "rollmesh.bytes": plan.stream.total_bytes,
                      "rollmesh.delta_base_version": plan.delta.base_version if plan.delta is not None else -1}
        span = (self.tracer.start_as_current_span("weights.broadcast", attributes=attributes)
                if self.tracer is not None else contextlib.nullcontext())
        with span:
            try:
                async with asyncio.timeout(plan.timeout_s):
                    built_before = self.groups_built
                    group = await asyncio.to_thread(cache.get, plan.group_id, plan.members,
                                                    (self._host, self._port), plan.backend, plan.sync_key)
                    reused = self.groups_built == built_before
                    trace.get_current_span().set_attribute("rollmesh.group_reused", reused)
                    delta = prepared.deltas.get(plan.delta.base_version) if plan.delta is not None else None
                    if delta is not None:
                        sent = await send_weights_async(group, delta.manifest, iter(delta.tensors),
                                                        timeout=plan.timeout_s, key=plan.sync_key)
                    else:
                        sent = await send_weights_async(group, prepared.manifest, iter(prepared.snapshot.tensors),
                                                        timeout=plan.timeout_s, key=plan.sync_key)
            except TimeoutError:
                raise DeadlineExceeded(f"weight broadcast {plan.sync_id} did not finish within its timeout of "
                                       f"{plan.timeout_s:g} s", reason=Reason.WEIGHT_TRANSFER_TIMEOUT) from None
            except TransferTimeout as err:
                raise DeadlineExceeded(f"weight broadcast {plan.sync_id}: {err}", reason=err.reason) from err
        result = SendResult(sent.bytes, time.monotonic() - started, prepared.manifest.checksum, plan.weight_version,
                            group_reused=reused)
        self._results[plan.sync_id] = result
        while len(self._results) > _RECORDED_SYNCS:
            self._results.popitem(last=False)
        log.info("sent weight version %d%s to %d receiver(s) over %s group %s: %d bytes in %.3f s (sync %s)",
                 plan.weight_version,
                 f" as a delta from {plan.delta.base_version}" if plan.delta is not None else "",
                 len(plan.members) - 1, "a reused" if reused else "a new", plan.group_id,
                 sent.bytes, result.duration_s, plan.sync_id)
        return result

    def _check_started(self) -> GroupCache:
        if self._cache is None:
            raise FailedPrecondition("the trainer agent is not started or is shutting down", reason=Reason.NOT_STARTED)
        return self._cache
