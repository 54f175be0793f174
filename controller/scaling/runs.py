"""The bodies of scale operations: what each state does, and how each is undone.

Scale-out: CREATING launches STANDALONE replicas on free slots through the
agents' LaunchReplica (native), or CONNECTING adopts the serving replicas of
replica agents given by address (external); HEALTH_CHECKING asks each agent
that its replica is ACTIVE; WEIGHT_SYNCING brings every replica behind the
current weight version up to it (a replica never takes traffic at an older
version) from the source ``scale_out_weight_source`` names: the trainer, a
healthy ACTIVE replica already at that version (seed-replica sync through
the replica agent's PrepareWeightSync/SendWeights), or ``auto`` (the
trainer when it is configured and prepares the version, else a seed); READY puts them into the load balancer;
ACTIVE once the balancer routes them. After each stage the partial-success
policy decides: ``rollback_all`` fails the operation on any failure,
``keep_partial`` releases only the failed replicas.

Scale-in: PENDING waits for a running weight sync; DRAINING takes the
replicas out of routing (requests in flight finish) and waits up to the
drain timeout (not at all with ``force``), then aborts what is left so the
balancer resumes it elsewhere; REMOVING stops each replica within the
shutdown timeout, then by force, and marks it intentionally removed.
Removed replicas stay removed (partial success); a failed scale-in puts the
replicas it had not removed yet back into routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from mesh_runtime.validate import is_engine_url
from rollmesh.common.v1 import types_pb2

from ..agents import why
from ..core.events import EventType
from .operations import OperationState, ScaleOperation
from ..core.records import ReplicaKind, ReplicaSpec, ReplicaState

log = logging.getLogger(__name__)
if TYPE_CHECKING:
    from ..core.ports import WeightSyncOutcome
    from .ports import ScaleHost

OS = OperationState
S = ReplicaState
_POLL_S = 0.2


class ScaleFailed(Exception):
    """A stage failed in a way the operation cannot go on from (the message says why)."""


async def _gather(items: Sequence[str], one: Callable[[str], Awaitable[object]]) -> dict[str, str]:
    """Run ``one(item)`` for each item concurrently; item -> why for the failures."""
    results = await asyncio.gather(*(one(i) for i in items), return_exceptions=True)
    failed = {}
    for item, result in zip(items, results):
        if isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, BaseException):
            failed[item] = why(result)
    return failed


# ------------------------------------------------------------------ scale-out
async def run_out(s: ScaleHost, op: ScaleOperation, placements: list[str]) -> None:
    with s.span("scale.out", operation_id=op.operation_id, model_name=op.model_name,
                      target=op.num_replicas, addresses=op.engine_addresses):
        if op.engine_addresses:
            failed = await _connect(s, op)
        else:
            failed = await _create(s, op, placements)
        alive = await _settle(s, op, failed, "start")
        await s.move(op, OS.HEALTH_CHECKING, f"{len(alive)} replica(s) up; checking their health")
        alive = await _settle(s, op, await _health(s, op, alive), "health check")
        await _sync(s, op, alive)
        await _route(s, op, [r for r in op.replica_ids if r not in op.failed_replica_ids])


async def _create(s: ScaleHost, op: ScaleOperation, placements: list[str]) -> dict[str, str]:
    registry, per = s.registry, s.config.rollout_num_gpus_per_engine
    for index, node_id in enumerate(placements):
        replica_id = f"{node_id}-x{op.operation_id[:6]}{index}"
        registry.add_replica(ReplicaSpec(replica_id, ReplicaKind.STANDALONE), node_id=node_id,
                             operation_id=op.operation_id, reason=f"launched by scale-out {op.operation_id}")
        op.replica_ids.append(replica_id)
        op.launched_replica_ids.append(replica_id)
    await s.move(op, OS.CREATING, f"launching {op.replica_ids} on {sorted(set(placements))}")

    async def launch(replica_id: str) -> None:
        record = registry.get(replica_id)
        with s.span("replica.launch", replica_id=replica_id, node_id=record.node_id):
            replica = await s.calls.launch(record.address, replica_id, slots=per, timeout_s=op.timeout_s,
                                           request_id=f"{op.operation_id}:{replica_id}")
        record.slots, record.data_address = tuple(replica.slots), replica.data_address
        registry.touch(record.node_id)
        registry.set_weight_version(replica_id, replica.weight_version)
        registry.transition(replica_id, S.LOADING, "launched; health check next", operation_id=op.operation_id)

    with s.span("scale.out.create", operation_id=op.operation_id, replica_ids=op.replica_ids):
        return await _gather(list(op.replica_ids), launch)


async def _connect(s: ScaleHost, op: ScaleOperation) -> dict[str, str]:
    registry, per = s.registry, s.config.rollout_num_gpus_per_engine
    await s.move(op, OS.CONNECTING, f"connecting to {op.engine_addresses}")

    async def connect(address: str) -> None:
        status = await s.calls.status(address)
        known = next((n for n in registry.nodes() if n.node_id == status.node_id), None)
        if known is not None and known.external and not known.lease_held:
            # An external node whose lease ran out (its replicas FAILED): connect it afresh.
            registry.forget_node(known.node_id, f"reconnected by scale-out {op.operation_id}")
        if status.node_id in {n.node_id for n in registry.nodes()}:
            raise ScaleFailed(f"node id {status.node_id!r} at {address} is already registered at "
                              f"{registry.node(status.node_id).address}")
        serving = [r for r in await s.calls.replicas(address)
                   if r.kind == types_pb2.REPLICA_KIND_STANDALONE and r.state == types_pb2.REPLICA_STATE_ACTIVE]
        launched = []
        if not serving:
            if status.slots_free < per:
                raise ScaleFailed(f"agent {address} has no serving standalone replica and {status.slots_free} "
                                  f"free slot(s) (needs {per})")
            replica_id = f"{status.node_id}-x{op.operation_id[:6]}0"
            serving = [await s.calls.launch(address, replica_id, slots=per, timeout_s=op.timeout_s,
                                            request_id=f"{op.operation_id}:{replica_id}")]
            launched = [replica_id]
        specs = [ReplicaSpec(r.replica_id, ReplicaKind.STANDALONE, S.LOADING, weight_version=r.weight_version,
                             slots=tuple(r.slots), memory_fraction=r.memory_fraction, data_address=r.data_address)
                 for r in serving]
        registry.register_node(status.node_id, address, replicas=specs, slots_total=status.slots_total,
                               backend=types_pb2.EngineBackend.Name(status.backend), model=status.model,
                               model_name=op.model_name, agent_version="external")
        registry.node(status.node_id).external = True
        registry.touch(status.node_id)
        for spec in specs:
            record = registry.get(spec.replica_id)
            record.added_by_operation_id, record.initial = op.operation_id, False
            op.replica_ids.append(spec.replica_id)
        op.launched_replica_ids.extend(launched)
        await s.save()  # the adoption and the operation that owns it reach the disk together

    async def attach(url: str) -> None:
        """An SGLang server given by URL: a replica agent of the sglang backend attaches a replica to it."""
        hosts = [n for n in registry.nodes() if n.backend == "ENGINE_BACKEND_SGLANG" and n.lease_held
                 and n.model_name == op.model_name]
        if not hosts:
            raise ScaleFailed(f"no registered replica agent of the sglang backend serves model {op.model_name!r} "
                              f"to attach {url} to")
        node = min(hosts, key=lambda n: (len(registry.replicas(node_id=n.node_id)), n.node_id))
        replica_id = f"{node.node_id}-x{op.operation_id[:6]}{op.engine_addresses.index(url)}"
        registry.add_replica(ReplicaSpec(replica_id, ReplicaKind.STANDALONE, engine_url=url), node_id=node.node_id,
                             operation_id=op.operation_id, reason=f"attached to {url} by scale-out {op.operation_id}")
        op.replica_ids.append(replica_id)
        op.launched_replica_ids.append(replica_id)
        await s.save()
        with s.span("replica.attach", replica_id=replica_id, node_id=node.node_id, engine_url=url):
            replica = await s.calls.launch(node.address, replica_id, slots=0, engine_url=url, timeout_s=op.timeout_s,
                                           request_id=f"{op.operation_id}:{replica_id}")
        registry.set_weight_version(replica_id, replica.weight_version)
        registry.transition(replica_id, S.LOADING, f"attached to {url}; health check next",
                            operation_id=op.operation_id)

    def one(address: str) -> Awaitable[object]:
        return attach(address) if is_engine_url(address) else connect(address)

    with s.span("scale.out.connect", operation_id=op.operation_id, addresses=op.engine_addresses):
        failed = await _gather(list(op.engine_addresses), one)
    await s.save()
    return failed


async def _health(s: ScaleHost, op: ScaleOperation, alive: list[str]) -> dict[str, str]:
    registry = s.registry

    async def check(replica_id: str) -> None:
        replica = await s.calls.replica(registry.get(replica_id).address, replica_id)
        if replica.state != types_pb2.REPLICA_STATE_ACTIVE:
            raise ScaleFailed(f"agent reports {types_pb2.ReplicaState.Name(replica.state)} "
                              f"({replica.state_reason or 'no reason'})")

    with s.span("scale.out.health_check", operation_id=op.operation_id, replica_ids=alive):
        return await _gather(alive, check)


async def _settle(s: ScaleHost, op: ScaleOperation, failed: dict[str, str], stage: str) -> list[str]:
    """Apply the partial-success policy to a stage's failures; the replicas that go on."""
    if failed:
        op.failed_replica_ids.extend(f for f in failed if f not in op.failed_replica_ids)
        details = "; ".join(f"{k}: {v}" for k, v in failed.items())
        alive = [r for r in op.replica_ids if r not in op.failed_replica_ids]
        if not alive:
            raise ScaleFailed(f"every new replica failed at {stage}: {details}")
        if op.partial_success_policy == "rollback_all":
            raise ScaleFailed(f"{len(failed)} new replica(s) failed at {stage} (policy rollback_all): {details}")
        op.error_message = (op.error_message + "; " if op.error_message else "") + f"{stage}: {details}"
        await release(s, op, [r for r in failed if r in op.replica_ids], "failed; released (keep_partial)")
        await s.save()
    return [r for r in op.replica_ids if r not in op.failed_replica_ids]


async def _sync(s: ScaleHost, op: ScaleOperation, alive: list[str]) -> None:
    """Bring the new replicas to the current weight version before they are routed.

    The bulk of a join is a full copy from a peer at the newest version a healthy replica holds, which runs
    outside the transitions lock: the training steps' syncs (which take it) go on meanwhile, and the peer sends
    from a copy of its weights, so it takes its own syncs too; while the steps run more than one version
    ahead of it, it copies again (:func:`_keep_up`). Only when no peer can is the copy the trainer's, under the
    lock (the trainer sends one broadcast at a time). Then, under the lock, the new replicas catch up with the
    version the steps are at (a delta from the trainer where it holds the version they got), so none is
    routed behind.
    """
    registry = s.registry
    version = s.current_version(op.model_name, exclude=set(op.replica_ids))
    behind = [r for r in alive if version is not None and registry.get(r).weight_version < version]
    await s.move(op, OS.WEIGHT_SYNCING, f"syncing {behind} to weight version {version}" if behind else
           f"every new replica already holds the current weight version ({version})")
    for replica_id in alive:
        registry.transition(replica_id, S.SYNCING, "weight sync before serving", operation_id=op.operation_id)
    failed: dict[str, str] = {}
    if behind and version is not None:   # (behind is empty without a version)
        source = s.config.scale_out_weight_source
        copied = False
        held, seeds = newest_seeds(s, op, version)   # a sync may be taking the serving replicas to `version`
        if source == "replica" or (source == "auto" and seeds):
            outcome = await _copy(s, op, behind, held, "replica", seeds)
            copied = source == "replica" or any(r.ok for r in outcome.replica_results)
            if copied:
                failed = dict(outcome.failed)
                await _keep_up(s, op, [r for r in behind if r not in failed])
        async with s.transitions:
            current = s.current_version(op.model_name, exclude=set(op.replica_ids))
            if current is not None:   # the version the steps are at now that the lock is held: the trainer's
                version = current
            if not copied:
                outcome = await _copy(s, op, behind, version, "trainer", [])
                failed = dict(outcome.failed)
            lagging = [] if current is None else [r for r in alive if r not in failed
                                                  and registry.get(r).weight_version < current]
            if lagging:
                outcome = await _copy(s, op, lagging, version, "catch-up", [])   # version == current here
                failed.update(outcome.failed)
    alive = await _settle(s, op, failed, "weight sync")
    op.weight_version = version if version is not None else min(registry.get(r).weight_version for r in alive)


KEEP_UP_ROUNDS = 2
"""Peer copies a join makes, after its first, while the steps run ahead of it (:func:`_keep_up`)."""


async def _keep_up(s: ScaleHost, op: ScaleOperation, replica_ids: list[str]) -> None:
    """Copy the newest version from peers again, still outside the lock, while the steps have moved on by more
    than one version since the new replicas' copy began.

    The catch-up under the lock is a delta from the version the new replicas hold while the trainer keeps
    the deltas since it (``weight_transfer.delta_history``), a full copy that the steps wait for beyond; the
    fewer versions behind, the smaller the delta. At most :data:`KEEP_UP_ROUNDS` rounds: a copy slower than a
    step never catches up by itself. A replica a round fails keeps the version it had, for the catch-up.
    """
    registry = s.registry
    for _ in range(KEEP_UP_ROUNDS):
        current = s.current_version(op.model_name, exclude=set(op.replica_ids))
        have = min((registry.get(r).weight_version for r in replica_ids), default=None)
        if current is None or have is None or current <= have + 1:
            return
        held, seeds = newest_seeds(s, op, current)
        if not seeds or held <= have:
            return
        await _copy(s, op, [r for r in replica_ids if registry.get(r).weight_version < held], held, "replica",
                    seeds)


def newest_seeds(s: ScaleHost, op: ScaleOperation, version: int) -> tuple[int, list[str]]:
    """The newest version at most ``version`` that healthy replicas hold, and those replicas (see
    :func:`seed_replicas`); ``(version, [])`` when none holds any."""
    held = sorted({r.weight_version for r in s.registry.replicas() if r.weight_version <= version}, reverse=True)
    for candidate in held:
        seeds = seed_replicas(s, op, candidate)
        if seeds:
            return candidate, seeds
    return version, []


async def _copy(s: ScaleHost, op: ScaleOperation, replica_ids: list[str], version: int, source: str,
                seeds: list[str]) -> WeightSyncOutcome:
    """One sync of new replicas to ``version``: from a peer (``replica``), the trainer (``trainer``), or the
    trainer's sync of a version the steps moved on to meanwhile (``catch-up``, a delta where it can be)."""
    registry = s.registry
    s.emit(EventType.WEIGHT_SYNC_STARTED, weight_version=version, operation_id=op.operation_id,
           reason=f"scale-out {op.operation_id}" + (": catching up" if source == "catch-up" else ""),
           attributes={"replicas": len(replica_ids)})
    with s.span("weights.broadcast", weight_version=version, replica_ids=replica_ids, operation_id=op.operation_id,
                weight_source=source, seeds=seeds):
        if source == "catch-up":
            outcome = await s.weights.sync(replica_ids, version)
        else:
            outcome = await s.weights.sync_new_replicas(replica_ids, version, seeds=seeds, source=source)
    for result in outcome.replica_results:
        if result.ok:
            registry.set_weight_version(result.replica_id, version)
    failed = outcome.failed
    s.routing.stale.difference_update(replica_ids)
    kind = EventType.WEIGHT_SYNC_FAILED if failed else EventType.WEIGHT_SYNC_COMPLETED
    s.emit(kind, weight_version=version, operation_id=op.operation_id,
           reason=f"scale-out {op.operation_id}: " + ("; ".join(failed.values()) or "ok"),
           attributes={"ok": len(replica_ids) - len(failed), "failed": len(failed),
                       "source": outcome.source if len(failed) < len(replica_ids) else "none",
                       "sync_id": outcome.sync_id, "duration_s": outcome.duration_s, **outcome.attributes()})
    return outcome


def seed_replicas(s: ScaleHost, op: ScaleOperation, version: int) -> list[str]:
    """Healthy replicas that may seed new ones: ACTIVE, of the model, at ``version``, owned by no operation.

    Standalone ones first (a hybrid replica may be put to sleep by the next step); never one that
    missed a sync (stale), that a scale-in is removing, or that this operation added.
    """
    registry = s.registry
    candidates = [r for r in registry.replicas()
                  if r.model_name == op.model_name and r.state is S.ACTIVE and r.weight_version == version
                  and r.replica_id not in op.replica_ids and r.replica_id not in s.routing.stale
                  and not s.blocks_routing(r)]
    candidates.sort(key=lambda r: (r.kind is not ReplicaKind.STANDALONE, r.replica_id))
    return [r.replica_id for r in candidates]


async def _route(s: ScaleHost, op: ScaleOperation, alive: list[str]) -> None:
    registry = s.registry
    async with s.transitions:
        for replica_id in alive:
            registry.transition(replica_id, S.ACTIVE, f"holds weight version {op.weight_version}; routed",
                                operation_id=op.operation_id)
        await s.routing.bring_in(alive)
        await s.move(op, OS.READY, f"{alive} at weight version {op.weight_version} added to the load balancer")
    routed = await s.calls.routed()
    missing = sorted(set(alive) - routed) if routed is not None else []
    if missing:
        raise ScaleFailed(f"the load balancer does not route {missing}")
    kept = f"; kept {len(alive)} of {len(op.replica_ids)} (keep_partial)" if op.failed_replica_ids else ""
    await s.move(op, OS.ACTIVE, f"{alive} serve requests{kept}")


async def release(s: ScaleHost, op: ScaleOperation, replica_ids: list[str], reason: str) -> None:
    """Take replicas an operation added out of routing and out of the mesh, stopping what it launched."""
    registry = s.registry
    ids = [r for r in replica_ids if r in registry]
    if not ids:
        return
    with contextlib.suppress(Exception):
        await s.routing.take_out(ids, why=reason)
    s.routing.stale.difference_update(ids)

    async def stop(replica_id: str) -> None:
        await s.calls.stop(registry.get(replica_id).address, replica_id, grace_s=0.0, force=True)

    stopped = [r for r in ids if r in op.launched_replica_ids]
    for replica_id, err in (await _gather(stopped, stop)).items():
        log.warning("could not stop %s while rolling back %s: %s (its agent will be told to stop it when it "
                    "registers again)", replica_id, op.operation_id, err)
    external = set()
    for replica_id in ids:
        record = registry.get(replica_id)
        node = next((n for n in registry.nodes() if n.node_id == record.node_id), None)
        if node is not None and node.external:
            external.add(node.node_id)
            continue
        if record.state is not S.REMOVED:
            registry.transition(replica_id, S.STOPPED, f"{reason} ({op.operation_id})", operation_id=op.operation_id)
            registry.mark_removed(replica_id, f"{reason} ({op.operation_id})", operation_id=op.operation_id)
    for node_id in sorted(external):
        if all(r.added_by_operation_id == op.operation_id for r in registry.replicas(node_id=node_id)):
            registry.forget_node(node_id, f"external connection {reason} ({op.operation_id})")


async def rollback_out(s: ScaleHost, op: ScaleOperation) -> None:
    owned = [r.replica_id for r in s.registry.replicas() if r.added_by_operation_id == op.operation_id]
    ids = list(dict.fromkeys([*op.replica_ids, *owned]))
    with s.span("scale.out.rollback", operation_id=op.operation_id, replica_ids=ids):
        await release(s, op, ids, "rolled back")
    await s.save()


async def resume_ready(s: ScaleHost, op: ScaleOperation) -> None:
    """After a restart: a READY scale-out has synced its replicas; route them again and finish."""
    alive = [r for r in op.replica_ids if r not in op.failed_replica_ids and r in s.registry
             and s.registry.get(r).state is S.ACTIVE]
    if not alive:
        raise ScaleFailed("controller restarted and none of its replicas is serving")
    await s.routing.bring_in(alive)
    await s.move(op, OS.ACTIVE, f"resumed after controller restart: {alive} serve requests")


async def restart_failed(s: ScaleHost, op: ScaleOperation) -> None:
    raise ScaleFailed("controller restarted; the operation was rolled back")


# ------------------------------------------------------------------- scale-in
async def run_in(s: ScaleHost, op: ScaleOperation, *, resumed: bool = False) -> None:
    registry = s.registry
    ids = list(op.replica_ids)
    with s.span("scale.in", operation_id=op.operation_id, replica_ids=ids, force=op.force):
        if op.state is OS.PENDING:
            while s.weights.in_progress:
                await s.weights.wait_idle()
            async with s.transitions:  # never while a hybrid transition or weight sync runs
                s.removing.update(ids)
                for replica_id in ids:
                    if registry.get(replica_id).state in (S.ACTIVE, S.PAUSED, S.SYNCING):
                        registry.transition(replica_id, S.DRAINING, f"scale-in {op.operation_id}: draining",
                                            operation_id=op.operation_id)
                await s.routing.take_out(ids, why=f"scale-in {op.operation_id}")
                await s.move(op, OS.DRAINING, "out of routing; " + ("force: in-flight requests are aborted now"
                                                             if op.force else "in-flight requests finish"))
        s.removing.update(ids)
        if op.state is OS.DRAINING:
            drained = await _drain(s, op, ids, force=op.force or resumed)
            await s.move(op, OS.REMOVING, drained)
        failed = await _remove(s, op, ids)
        s.removing.difference_update(ids)
        op.failed_replica_ids = sorted(failed)
        if failed and len(failed) == len(ids):
            raise ScaleFailed("no replica could be stopped: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
        if failed:
            op.error_message = "not stopped cleanly: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
        await s.move(op, OS.COMPLETED, ("resumed after controller restart; " if resumed else "") +
               f"removed {[r for r in ids if r not in failed]}" + (f"; failed {sorted(failed)}" if failed else ""))


async def _drain(s: ScaleHost, op: ScaleOperation, ids: list[str], *, force: bool) -> str:
    registry, timeout = s.registry, s.config.scale_in_drain_timeout
    # Every replica that may still run requests (an agent that re-registered meanwhile reports ACTIVE again).
    live = [r for r in ids if registry.get(r).state not in (S.REMOVED, S.STOPPED, S.FAILED)]
    busy: dict[str, int] = {}
    with s.span("scale.in.drain", operation_id=op.operation_id, replica_ids=live, force=force):
        deadline = asyncio.get_running_loop().time() + (0.0 if force else timeout)
        while live:
            counts = await asyncio.gather(*(s.calls.in_flight(registry.get(r).address, r) for r in live),
                                          return_exceptions=True)
            busy = {r: c for r, c in zip(live, counts) if isinstance(c, int) and c > 0}
            if not busy or asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        if not busy:
            return "drained: no request in flight"

        async def abort(replica_id: str) -> None:
            await s.calls.abort_all(registry.get(replica_id).address, replica_id)

        failed = await _gather(list(busy), abort)
    when = "force" if force else f"drain timeout ({timeout:g} s)"
    return (f"{when}: aborted the {sum(busy.values())} request(s) left on {sorted(busy)}; the load balancer "
            "resumes them elsewhere" + (f"; abort failed on {failed}" if failed else ""))


async def _remove(s: ScaleHost, op: ScaleOperation, ids: list[str]) -> dict[str, str]:
    registry, grace = s.registry, s.config.scale_in_shutdown_timeout

    async def stop(replica_id: str) -> None:
        address = registry.get(replica_id).address
        try:
            await s.calls.stop(address, replica_id, grace_s=grace, force=False)
        except Exception as err:  # noqa: BLE001 - then by force
            log.warning("clean stop of %s failed (%s); stopping it by force", replica_id, why(err))
            await s.calls.stop(address, replica_id, grace_s=0.0, force=True)

    with s.span("scale.in.remove", operation_id=op.operation_id, replica_ids=ids):
        failed = await _gather([r for r in ids if registry.get(r).state is not S.REMOVED], stop)
    for replica_id in ids:
        record = registry.get(replica_id)
        if record.state is S.REMOVED:
            continue
        target = S.FAILED if replica_id in failed else S.STOPPED
        registry.transition(replica_id, target, f"scale-in {op.operation_id}: " +
                            (f"stop failed: {failed[replica_id]}" if replica_id in failed else "stopped"),
                            operation_id=op.operation_id)
        registry.mark_removed(replica_id, f"removed by scale-in {op.operation_id}", operation_id=op.operation_id)
    await s.save()
    return failed


async def resume_in(s: ScaleHost, op: ScaleOperation) -> None:
    await run_in(s, op, resumed=True)


async def restore_in(s: ScaleHost, op: ScaleOperation) -> None:
    """A scale-in that fails or times out puts the replicas it had not removed back into routing."""
    registry = s.registry
    back = [r for r in op.replica_ids if r in registry and registry.get(r).state in (S.DRAINING, S.ACTIVE)]
    s.removing.difference_update(op.replica_ids)
    for replica_id in back:
        registry.transition(replica_id, S.ACTIVE, f"scale-in {op.operation_id} did not finish; serving again",
                            operation_id=op.operation_id)
    if back:
        await s.routing.to_rule(back)
    await s.save()
