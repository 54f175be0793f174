"""Receiving and sending weights for the replicas of one node.

A receive moves each listed replica through SYNCING (new requests refused),
joins the plan's process group as that replica's rank, receives into fresh
memory, checks the checksum, and only then swaps the weights into the engine
(atomically: a failed or mismatched transfer leaves the old weights serving).
A sleeping replica receives into freshly woken weight memory and stays asleep.

A delta plan is applied where the engine's weights lie when the engine lends
them (``patches_weights_in_place``: the torch engine), else to a copy of what
the replica serves laid out as the target, which the engine then loads; either
way the result is checked against the target before it serves, and a refused
delta leaves the old weights serving. A hybrid replica asleep at level 1 wakes
its weights (they come back bit for bit) to be that base. One that does not
hold the base still receives the stream, keeps its weights and answers
``delta_base_missing``: the controller then gives it a full copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from mesh_runtime.errors import Aborted, FailedPrecondition, InvalidArgument
from mesh_runtime.reasons import Reason

from .engines.errors import EngineUnavailable
from .replicas import Replica, ReplicaManager

from .weights import PreparedSource, ReceiveResult, SendResult, WeightGroups

if TYPE_CHECKING:
    from weight_transfer import Manifest
    from weight_transfer.wire import SyncPlan

log = logging.getLogger(__name__)

_CANNOT_SYNC = ("LAUNCHING", "LOADING", "FAILED", "STOPPED")


def _check_receivable(replica: Replica, plan: SyncPlan, abort_in_flight: bool) -> None:
    from weight_transfer import validate_against  # noqa: PLC0415 - torch only when syncing

    if replica.state in _CANNOT_SYNC:
        raise FailedPrecondition(f"replica {replica.replica_id!r} is {replica.state} and cannot receive weights",
                                 reason=Reason.WRONG_REPLICA_STATE)
    if replica.busy == "weights":
        raise Aborted(f"replica {replica.replica_id!r} is already receiving or sending weights",
                      reason=Reason.TRANSFER_IN_PROGRESS)
    if plan.rank_of(replica.replica_id) in (None, 0):
        raise FailedPrecondition(f"replica {replica.replica_id!r} has no receiving rank in plan {plan.sync_id}",
                                 reason=Reason.NOT_IN_PLAN)
    validate_against(plan.manifest, [(s.name, s.dtype, s.shape) for s in replica.engine.weight_spec()])
    if replica.in_flight and not abort_in_flight:
        raise FailedPrecondition(f"replica {replica.replica_id!r} has {len(replica.in_flight)} request(s) in "
                                 "flight; abort them first or set abort_in_flight", reason=Reason.REQUESTS_IN_FLIGHT)


async def receive(manager: ReplicaManager, groups: WeightGroups, replica_ids: list[str], plan: SyncPlan,
                  abort_in_flight: bool) -> list[ReceiveResult]:
    """Receive ``plan`` into every listed replica concurrently; all are checked before any starts."""
    replicas = [manager.get(i) for i in replica_ids]
    recorded = [groups.results.get((plan.sync_id, r.replica_id)) for r in replicas]
    if all(recorded):
        return [r for r in recorded if r is not None]
    for replica in replicas:
        _check_receivable(replica, plan, abort_in_flight)
    return list(await asyncio.gather(*(_receive_one(groups, r, plan) for r in replicas)))


@contextlib.asynccontextmanager
async def swapping_weights(replica: Replica, *, abort: bool = True) -> AsyncIterator[bool]:
    """Hold ``replica`` while its weights change (a broadcast received, a checkpoint loaded or reverted): its
    lock, the SYNCING phase (new requests wait for the end when it was serving, see ``sync_wait_s``), its
    in-flight requests aborted (they resume through the balancer; with ``abort`` False the caller aborts them
    itself before the weights change). Yields whether its weights were asleep."""
    async with replica.lock:
        weights_asleep = replica.state == "SLEEPING"
        serving = replica.state == "ACTIVE"
        previous_phase, replica.phase, replica.busy = replica.phase, "SYNCING", "weights"
        if serving:
            replica.serving_through_sync = True
            replica.synced.clear()
        try:
            if abort and replica.in_flight:
                await replica.engine.abort(None)
            yield weights_asleep
        finally:
            replica.phase, replica.busy = previous_phase, ""
            replica.serving_through_sync = False
            replica.synced.set()


async def _receive_one(groups: WeightGroups, replica: Replica, plan: SyncPlan) -> ReceiveResult:
    from weight_transfer import VerificationFailed, receive_weights_async  # noqa: PLC0415

    started = time.monotonic()
    async with swapping_weights(replica, abort=False) as weights_asleep:
        # The in-flight requests are aborted while the stream arrives, into memory of its own: an abort waits
        # for the decode step in progress, which is most of a small model's sync.
        quiet = asyncio.ensure_future(replica.engine.abort(None)) if replica.in_flight else None
        in_place = plan.delta is not None and replica.engine.patches_weights_in_place
        # a delta's base (what this replica serves, laid out as the target) is packed while the stream arrives,
        # unless the engine takes the delta where its weights lie
        base_task = (asyncio.ensure_future(_delta_base(replica, plan, weights_asleep))
                     if plan.delta is not None and not in_place else None)
        try:
            group = await asyncio.to_thread(groups.cache(replica.replica_id).get, plan.group_id, plan.members,
                                            plan.rendezvous, plan.backend, plan.sync_key)
            received = await receive_weights_async(group, plan.stream, timeout=plan.timeout_s, key=plan.sync_key)
            if quiet is not None:   # no request runs on the weights from here on
                await quiet
            why, tensors = "", received
            if in_place:
                why = await _patch_in_place(replica, plan, received, weights_asleep)
            elif base_task is not None:
                base = await base_task
                why = base if isinstance(base, str) else ""
                if not why:
                    try:
                        tensors = await asyncio.to_thread(_apply_delta, plan, base, received)
                    except VerificationFailed:   # only now is the base checked: the target check covers it
                        if not (why := await _not_the_base(replica, plan)):
                            raise
            if why:   # the group is in step; this replica needs a full copy
                log.info("replica %s: %s; it keeps weight version %d and needs a full copy",
                         replica.replica_id, why, replica.weight_version)
                result = ReceiveResult(replica.replica_id, replica.weight_version, False,
                                       plan.stream.total_bytes, time.monotonic() - started, why,
                                       delta_base_missing=True)
                groups.record(plan.sync_id, replica.replica_id, result)
                return result
        except VerificationFailed as err:   # a bad checksum, or not from the sender the controller chose
            log.warning("replica %s: %s; keeping weight version %d", replica.replica_id, err,
                        replica.weight_version)
            result = ReceiveResult(replica.replica_id, replica.weight_version, False, plan.stream.total_bytes,
                                   time.monotonic() - started, str(err))
            groups.record(plan.sync_id, replica.replica_id, result)
            return result
        finally:
            if base_task is not None and not base_task.done():
                base_task.cancel()
                await asyncio.gather(base_task, return_exceptions=True)
            if quiet is not None:   # the plan asked for it whatever became of the stream
                await asyncio.gather(quiet, return_exceptions=True)
        if not in_place:
            if weights_asleep:
                await replica.engine.wake_up({"weights"})
            await replica.engine.load_weights(tensors, plan.weight_version)
        replica.weights_discarded = False
        groups.forget(replica.replica_id)  # its preparation as a source described the old weights
    result = ReceiveResult(replica.replica_id, plan.weight_version, True, plan.stream.total_bytes,
                           time.monotonic() - started)
    groups.record(plan.sync_id, replica.replica_id, result)
    log.info("replica %s now serves weight version %d (%d bytes%s in %.3f s)", replica.replica_id,
             plan.weight_version, result.bytes_received,
             f" of a delta from {plan.delta.base_version}{' in place' if in_place else ''}"
             if plan.delta is not None else "", result.duration_s)
    return result


def _without_base(replica: Replica, plan: SyncPlan) -> str:
    """Why ``replica`` cannot be the base of the plan's delta by what it records (another version, weights
    discarded), or ""."""
    assert plan.delta is not None
    if replica.weight_version != plan.delta.base_version:
        return (f"the plan is a delta from weight version {plan.delta.base_version}, and this replica serves "
                f"{replica.weight_version}")
    if replica.weights_discarded:
        return "the plan is a delta and this replica's weights were discarded (it slept at level 2)"
    return ""


async def _wake_base(replica: Replica, weights_asleep: bool) -> str:
    """Wake the weights of a replica asleep at level 1 (they come back bit for bit) to apply a delta to; why
    not, when they cannot be woken."""
    if weights_asleep:
        try:
            await replica.engine.wake_up({"weights"})
        except Exception as err:   # noqa: BLE001 - then it takes a full copy, received while asleep
            return f"the plan is a delta and this replica's weights could not be woken ({err})"[:300]
    return ""


async def _delta_base(replica: Replica, plan: SyncPlan, weights_asleep: bool) -> Any:
    """The weights ``replica`` serves packed in the target's layout; or, when it cannot be the base, why (a
    string). Their checksum is not compared with the base's here: the result of the delta is checked against
    the target, which a wrong base fails, and only then :func:`_not_the_base` tells the two failures apart
    (one pass over the weights fewer per delta)."""
    from weight_transfer import ManifestMismatch  # noqa: PLC0415

    if why := _without_base(replica, plan) or await _wake_base(replica, weights_asleep):
        return why
    try:
        return await _packed(replica, plan.manifest)
    except ManifestMismatch as err:
        return f"the weights this replica serves do not fit the delta's layout: {err}"
    except Exception as err:   # noqa: BLE001 - an engine that cannot read its weights back takes full copies
        return f"the plan is a delta and this replica's engine cannot read back its weights ({err})"[:300]


async def _patch_in_place(replica: Replica, plan: SyncPlan, received: dict, weights_asleep: bool) -> str:
    """Apply the received delta to the weights ``replica`` serves, where they lie (engines that lend them):
    "" once it serves the target; else why it needs a full copy, its weights as they were. Raises
    ``VerificationFailed`` when the delta itself fails (refused, or not the target), its weights as they
    were."""
    from weight_transfer import DeltaRefused, InvalidManifest, ManifestMismatch, VerificationFailed  # noqa: PLC0415
    from weight_transfer.delta_in_place import apply_delta_in_place  # noqa: PLC0415

    delta = plan.delta
    assert delta is not None
    if why := _without_base(replica, plan) or await _wake_base(replica, weights_asleep):
        return why

    def patch(named: list[tuple[str, Any]]) -> None:
        try:
            apply_delta_in_place(plan.manifest, named, delta.stream, received, key=plan.sync_key)
        except InvalidManifest as err:
            raise DeltaRefused(f"the delta from weight version {delta.base_version} was refused: {err}") from err

    try:
        await replica.engine.patch_weights(patch, plan.weight_version)
    except ManifestMismatch as err:
        return f"the weights this replica serves do not fit the delta's layout: {err}"
    except EngineUnavailable as err:
        return f"the plan is a delta and this replica's engine cannot change its weights now ({err})"[:300]
    except VerificationFailed:   # the weights are as they were: tell a wrong base from a bad delta
        if why := await _not_the_base(replica, plan):
            return why
        raise
    return ""


async def _not_the_base(replica: Replica, plan: SyncPlan) -> str:
    """Why the weights ``replica`` still serves are not the delta's base (their checksum against the base's),
    or "" when they are (then the delta itself failed its check)."""
    from weight_transfer.delta import stream_checksum  # noqa: PLC0415

    assert plan.delta is not None
    try:
        got = await asyncio.to_thread(stream_checksum, plan.manifest, await _packed(replica, plan.manifest))
    except Exception as err:   # noqa: BLE001 - then it cannot be checked as the base: a full copy it is
        return f"the plan is a delta and this replica's weights could not be read back to check ({err})"[:300]
    if got == plan.delta.base_checksum:
        return ""
    return (f"the weights this replica serves (checksum {got[:16]}) are not the delta's base version "
            f"{plan.delta.base_version} (checksum {plan.delta.base_checksum[:16]})")


async def _packed(replica: Replica, manifest: Manifest) -> Any:
    """A copy of the weights ``replica`` serves, laid out as ``manifest`` on the weights' own device (NCCL deltas
    apply there); ``ManifestMismatch`` when they do not fit it, the engine's error when it cannot read them."""
    from weight_transfer.delta import pack_stream  # noqa: PLC0415

    named = dict(replica.engine.named_weights())
    order = [(e.name, named[e.name]) for e in manifest.tensors if e.name in named]
    device = order[0][1].device if order else "cpu"
    return await asyncio.to_thread(pack_stream, manifest, order, device=device)


def _apply_delta(plan: SyncPlan, base: Any, received: dict) -> dict:
    """Apply the received delta to the packed base; the target's tensors, as views, once the result checks."""
    from weight_transfer import DeltaRefused, InvalidManifest, views_of  # noqa: PLC0415
    from weight_transfer.delta import apply_delta, check_stream  # noqa: PLC0415

    assert plan.delta is not None
    try:
        apply_delta(plan.manifest, base, plan.delta.stream, received)
    except InvalidManifest as err:
        raise DeltaRefused(f"the delta from weight version {plan.delta.base_version} was refused: {err}") from err
    check_stream(plan.manifest, base, key=plan.sync_key)
    return views_of(plan.manifest, base)


def _check_servable(replica: Replica) -> None:
    if replica.state not in ("ACTIVE", "PAUSED") or replica.weights_discarded:
        raise FailedPrecondition(f"replica {replica.replica_id!r} is {replica.state} and holds no servable weights",
                                 reason=Reason.NO_WEIGHTS)


async def prepare(manager: ReplicaManager, groups: WeightGroups, replica_id: str, *, weight_version: int,
                  bucket_size_bytes: int, checksum_algorithm: str, host: str) -> PreparedSource:
    """Lay a replica's current weights out in a manifest and host its rendezvous store on ``host``.

    A repeat with the same version, bucket size and algorithm returns the recorded
    preparation without hashing the weights again (while the replica still holds that version).
    """
    from weight_transfer import build_manifest  # noqa: PLC0415 - torch only when syncing

    replica = manager.get(replica_id)
    _check_servable(replica)
    if weight_version and replica.weight_version != weight_version:
        raise FailedPrecondition(f"replica {replica_id!r} holds weight version {replica.weight_version}, not the "
                                 f"requested {weight_version}", reason=Reason.VERSION_MISMATCH)
    if replica.busy == "weights":
        raise Aborted(f"replica {replica_id!r} is sending or receiving weights", reason=Reason.TRANSFER_IN_PROGRESS)
    key = (replica.weight_version, bucket_size_bytes, checksum_algorithm)
    recorded = groups.prepared.get(replica_id)
    if recorded is not None and recorded[0] == key:
        return recorded[1]
    async with replica.lock:  # no weight load swaps the tensors while they are hashed
        _check_servable(replica)
        version = replica.weight_version
        named = list(replica.engine.named_weights())
        manifest = await asyncio.to_thread(build_manifest, named, bucket_size_bytes,
                                           checksum_algorithm=checksum_algorithm)
    port = await asyncio.to_thread(groups.cache(replica_id).host_rendezvous, host, groups.ports.get(replica_id, 0))
    groups.ports[replica_id] = port
    prepared = PreparedSource(replica_id, version, manifest, (host, port))
    groups.prepared[replica_id] = ((version, bucket_size_bytes, checksum_algorithm), prepared)
    log.info("replica %s prepared weight version %d as a sync source (%d bytes, %s %s)", replica_id, version,
             manifest.total_bytes, checksum_algorithm, manifest.checksum)
    return prepared


async def send(manager: ReplicaManager, groups: WeightGroups, replica_id: str, plan: SyncPlan) -> SendResult:
    """Send a replica's weights as rank 0 of ``plan`` (a peer's full copy for replicas that need one).

    The weights are copied out first, under the replica's lock, and sent from the copy: the replica serves
    and may take a weight sync of its own while its copy is still on the wire (a join's copy never holds up
    a training step's sync). The copy costs one model's memory on the replica's device until the send ends.
    """
    from weight_transfer import send_weights_async  # noqa: PLC0415
    from weight_transfer.manifest import views_of  # noqa: PLC0415

    replica = manager.get(replica_id)
    if plan.source != replica_id:
        raise FailedPrecondition(f"plan {plan.sync_id} is sourced from {plan.source!r}, not {replica_id!r}",
                                 reason=Reason.NOT_PLAN_SOURCE)
    if plan.delta is not None:
        raise InvalidArgument(f"plan {plan.sync_id} is a delta; a replica sends full copies only",
                              reason=Reason.INVALID_SYNC_PLAN)
    started = time.monotonic()
    async with replica.lock:   # no weight load swaps the tensors while they are copied
        _check_servable(replica)
        if replica.weight_version != plan.weight_version:
            raise FailedPrecondition(f"replica {replica_id!r} holds weight version {replica.weight_version}, the "
                                     f"plan asks for {plan.weight_version}", reason=Reason.VERSION_MISMATCH)
        if replica.busy == "weights":
            raise Aborted(f"replica {replica_id!r} is already sending or receiving weights",
                          reason=Reason.TRANSFER_IN_PROGRESS)
        flat = await _packed(replica, plan.manifest)
    cache = groups.cache(replica_id)
    await asyncio.to_thread(cache.host_rendezvous, plan.rendezvous[0], plan.rendezvous[1])
    group = await asyncio.to_thread(cache.get, plan.group_id, plan.members, plan.rendezvous, plan.backend,
                                    plan.sync_key)
    copy = views_of(plan.manifest, flat)
    sent = await send_weights_async(group, plan.manifest, ((e.name, copy[e.name]) for e in plan.manifest.tensors),
                                    timeout=plan.timeout_s, key=plan.sync_key)
    return SendResult(sent.bytes, time.monotonic() - started, plan.manifest.checksum, plan.weight_version)
