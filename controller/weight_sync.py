"""``WeightBroadcast``: the controller's weight-sync coordinator (the core's ``WeightSyncPort`` over gRPC).

A weight sync: the source prepares the version (manifest + rendezvous), then
the source's SendWeights and every node's ReceiveWeights run concurrently
under one plan, and the replicas' new versions are pushed to the balancer.
The source is the trainer, or for the replicas a scale-out adds, a healthy
replica already at the version (seed-replica sync, ``sync_new_replicas``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc

from mesh_runtime.durations import to_seconds
from rollmesh.common.v1 import weights_pb2
from rollmesh.replica.v1 import replica_agent_pb2
from rollmesh.weights.v1 import weight_source_pb2

from .convert import duration
from .core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from .core.replicas import ReplicaRegistry
from .ports import Channels, describe_error
from .routing import Routing

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Source:
    """Rank 0 of a broadcast: how to prepare a version on it and how to make it send a plan."""

    what: str
    prepare: Callable[[int], Awaitable]
    send: Callable[[weights_pb2.WeightSyncPlan], Awaitable]
    rank0: weights_pb2.WeightSyncMember


class WeightBroadcast:
    """``WeightSyncPort``: rank 0 broadcasts to the replicas over one process group.

    Rank 0 is the trainer (``sync``), or for replicas a scale-out adds, the
    trainer or a healthy replica already at the version (``sync_new_replicas``,
    the replica agent's PrepareWeightSync and SendWeights).
    """

    def __init__(self, channels: Channels, registry: ReplicaRegistry, routing: Routing, *,
                 trainer_address: str, timeout_s: float, backend: str = "gloo", bucket_size_bytes: int = 0) -> None:
        self.channels = channels
        self.registry = registry
        self.routing = routing
        self.trainer_address = trainer_address
        self.timeout_s = timeout_s
        self.backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self._model_bytes = 0
        self.in_progress = 0
        """Weight syncs running now (a scale-in waits until none is)."""
        self._idle: asyncio.Event | None = None
        self._generations: dict[tuple[str, ...], int] = {}
        """Member set -> generation; bumped after a failed sync, because a group that saw a
        failure is retired on every member and its id cannot be used again."""

    def model_bytes(self) -> int:
        return self._model_bytes

    async def wait_idle(self) -> None:
        """Return once no weight sync is running."""
        while self.in_progress:
            if self._idle is None:
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def sync(self, replica_ids: Sequence[str], version: int, *,
                   timeout_s: float | None = None) -> WeightSyncOutcome:
        """Broadcast ``version`` from the trainer; ``timeout_s`` overrides the configured bound."""
        self.in_progress += 1
        try:
            return await self._sync(replica_ids, version, timeout_s or self.timeout_s)
        finally:
            self._done()

    async def sync_new_replicas(self, replica_ids: Sequence[str], version: int, *, seeds: Sequence[str],
                                source: str = "auto") -> WeightSyncOutcome:
        """Bring new replicas to ``version`` from the trainer or from a seed replica already at it.

        ``source``: ``trainer`` (the trainer only), ``replica`` (a seed only) or
        ``auto`` (the trainer when it is configured and prepares the version,
        else a seed). Seeds are tried in order until one prepares; a source
        that cannot prepare has moved no byte, so the next one is safe to try.
        Once a source has prepared, its outcome is the answer (no retry).
        """
        self.in_progress += 1
        try:
            started, errors = time.monotonic(), []
            if source in ("trainer", "auto"):
                if not self.trainer_address:
                    errors.append("no trainer_address configured")
                else:
                    outcome, prepare_error = await self._broadcast(replica_ids, version, self._trainer_source())
                    if not prepare_error or source == "trainer":
                        return outcome
                    errors.append(prepare_error)
                    log.warning("weight sync of %s to version %d: trainer not usable (%s); seeding from a replica",
                                list(replica_ids), version, prepare_error)
            if source in ("replica", "auto"):
                if not seeds:
                    errors.append(f"no healthy replica at weight version {version} to seed from")
                for seed in seeds:
                    outcome, prepare_error = await self._broadcast(replica_ids, version, self._replica_source(seed))
                    if not prepare_error:
                        return outcome
                    errors.append(prepare_error)
            sync_id = f"sync-{version}-{uuid.uuid4().hex[:8]}"
            return self._all_failed(replica_ids, version, sync_id, "no weight source: " + "; ".join(errors), started)
        finally:
            self._done()

    def _done(self) -> None:
        self.in_progress -= 1
        if not self.in_progress and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def _sync(self, replica_ids: Sequence[str], version: int, timeout_s: float) -> WeightSyncOutcome:
        if not self.trainer_address:
            return self._all_failed(replica_ids, version, f"sync-{version}-{uuid.uuid4().hex[:8]}",
                                    "no trainer_address configured", time.monotonic())
        outcome, _ = await self._broadcast(replica_ids, version, self._trainer_source(timeout_s), timeout_s)
        return outcome

    def _trainer_source(self, timeout_s: float | None = None) -> _Source:
        return self._source("trainer", self.trainer_address, "", weights_pb2.WeightSyncMember(rank=0),
                            timeout_s or self.timeout_s)

    def _replica_source(self, seed: str) -> _Source:
        address = self.registry.get(seed).address
        return self._source(f"seed replica {seed}", address, seed,
                            weights_pb2.WeightSyncMember(rank=0, replica_id=seed, address=address), self.timeout_s)

    def _source(self, what: str, address: str, source_id: str, member: weights_pb2.WeightSyncMember,
                timeout: float) -> _Source:
        """The WeightSourceService at ``address`` (a trainer agent: ``source_id`` empty; a replica agent: the
        seed replica) as the source of one broadcast."""

        stub = self.channels.weight_source(address)

        def prepare(version: int) -> Awaitable[weight_source_pb2.PrepareWeightSyncResponse]:
            request = weight_source_pb2.PrepareWeightSyncRequest(source_id=source_id, weight_version=version)
            if self.bucket_size_bytes:
                request.bucket_size_bytes = self.bucket_size_bytes
            return stub.PrepareWeightSync(request, timeout=timeout)

        return _Source(f"{what} PrepareWeightSync", prepare,
                       lambda plan: stub.SendWeights(weight_source_pb2.SendWeightsRequest(source_id=source_id,
                                                                                          plan=plan),
                                                     timeout=timeout),
                       member)

    async def _broadcast(self, replica_ids: Sequence[str], version: int, source: _Source,
                         timeout_s: float | None = None) -> tuple[WeightSyncOutcome, str]:
        """One broadcast from ``source``; the outcome and, when the source could not prepare, why.

        A group needs every member: when a node's agent cannot be reached, the
        others would only wait out the rendezvous. So the first UNAVAILABLE
        ReceiveWeights abandons the attempt at once (the sender and the other
        receivers are cancelled), and the sync is run once more, under a new
        group, without the unreachable nodes; their replicas fail and leave
        routing until a later sync reaches them.
        """
        timeout_s = timeout_s or self.timeout_s
        started = time.monotonic()
        outcome, why, unreachable = await self._attempt(replica_ids, version, source, timeout_s)
        if unreachable and not why:
            lost = [r for r in replica_ids if self.registry.get(r).address in unreachable]
            rest = [r for r in replica_ids if r not in lost]
            if rest:
                log.warning("weight sync to version %d: agent(s) %s unreachable; syncing the %d other replica(s) "
                            "without them", version, sorted(unreachable), len(rest))
                retry, why, _ = await self._attempt(rest, version, source, timeout_s)
                failed = [r for r in outcome.replica_results if r.replica_id in lost]
                outcome = dataclasses.replace(retry, replica_results=(*failed, *retry.replica_results),
                                              duration_s=time.monotonic() - started)
        if not why:  # a source that could not prepare moved nothing: the caller may try another
            await self.push_versions(list(outcome.replica_results), version)
        return outcome, why

    async def _attempt(self, replica_ids: Sequence[str], version: int, source: _Source,
                       timeout_s: float) -> tuple[WeightSyncOutcome, str, set[str]]:
        """One plan: prepare, then send and receive concurrently.

        Returns the outcome, why the source could not prepare (or ""), and the
        agent addresses that could not be reached.
        """
        sync_id = f"sync-{version}-{uuid.uuid4().hex[:8]}"
        if not replica_ids:
            return WeightSyncOutcome(weight_version=version, sync_id=sync_id), "", set()
        started = time.monotonic()
        try:
            prepared = await source.prepare(version)
        except grpc.aio.AioRpcError as err:
            why = f"{source.what}: {describe_error(err)}"
            return self._all_failed(replica_ids, version, sync_id, why, started), why, set()
        if prepared.weight_version != version:
            why = f"{source.what}: prepared weight version {prepared.weight_version}, not {version}"
            return self._all_failed(replica_ids, version, sync_id, why, started), why, set()
        self._model_bytes = prepared.manifest.total_bytes
        plan = self._plan(sync_id, prepared, list(replica_ids), source.rank0, timeout_s)
        by_node: dict[str, list[str]] = {}
        for replica_id in replica_ids:
            by_node.setdefault(self.registry.get(replica_id).address, []).append(replica_id)
        send = asyncio.ensure_future(source.send(plan))
        receives = {address: asyncio.ensure_future(self.channels.agent(address).ReceiveWeights(
            replica_agent_pb2.ReceiveWeightsRequest(replica_ids=ids, plan=plan, abort_in_flight=True),
            timeout=timeout_s)) for address, ids in by_node.items()}
        unreachable = await self._until_done_or_unreachable(send, receives)
        abandoned = (f"weight group abandoned: the agent(s) at {', '.join(sorted(unreachable))} could not be "
                     f"reached" if unreachable else "")
        results: list[ReplicaSyncOutcome] = []
        for address, ids in by_node.items():
            task = receives[address]
            if task.cancelled():
                results += [ReplicaSyncOutcome(r, False, abandoned) for r in ids]
                continue
            if (error := task.exception()) is not None:
                why = f"ReceiveWeights on {address}: {describe_error(error)}"
                results += [ReplicaSyncOutcome(r, False, why) for r in ids]
                continue
            for r in task.result().results:
                ok = r.checksum_ok and r.weight_version == version
                why = "" if ok else (r.error_message or "checksum mismatch")
                results.append(ReplicaSyncOutcome(r.replica_id, ok, why,
                                                  to_seconds(r.duration), r.bytes_received))
        bytes_sent = 0
        sent_error = None if send.cancelled() else send.exception()
        send_failed = send.cancelled() or sent_error is not None
        if send_failed:
            if sent_error is not None:
                log.warning("SendWeights from %s for %s failed: %s", prepared.source, sync_id,
                            describe_error(sent_error))
            cause = abandoned if sent_error is None else f"{prepared.source}: {describe_error(sent_error)}"
            results = [ReplicaSyncOutcome(r.replica_id, False, r.error_message or cause, r.duration_s,
                                          r.bytes_received) if not r.ok else r for r in results]
        else:
            bytes_sent = send.result().bytes_sent
        if send_failed or not all(r.ok for r in results):
            key = (prepared.source, *sorted(replica_ids))
            self._generations[key] = self._generations.get(key, 0) + 1
        return WeightSyncOutcome(weight_version=version, replica_results=tuple(results), bytes_sent=bytes_sent,
                                 duration_s=time.monotonic() - started, sync_id=sync_id,
                                 source=prepared.source), "", unreachable

    @staticmethod
    async def _until_done_or_unreachable(send: asyncio.Future, receives: Mapping[str, asyncio.Future]) -> set[str]:
        """Wait for every call; cancel the rest once the group cannot form. Returns unreachable addresses.

        The group cannot form when a receiver's agent is unreachable (UNAVAILABLE)
        or when the sender failed: nobody is left to send the bytes.
        """
        pending: set[asyncio.Future] = {send, *receives.values()}
        unreachable: set[str] = set()
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                unreachable |= {address for address, task in receives.items() if task in done and _unavailable(task)}
                sender_failed = send in done and (send.cancelled() or send.exception() is not None)
                if (unreachable or sender_failed) and pending:
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    pending = set()
        except asyncio.CancelledError:
            for task in (send, *receives.values()):
                task.cancel()
            raise
        return unreachable

    def _plan(self, sync_id: str, prepared: weight_source_pb2.PrepareWeightSyncResponse, replica_ids: list[str],
              rank0: weights_pb2.WeightSyncMember, timeout_s: float) -> weights_pb2.WeightSyncPlan:
        members = sorted(replica_ids)
        key = (prepared.source, *members)
        digest = hashlib.sha1("\0".join(key).encode()).hexdigest()[:12]
        group_id = f"g-{digest}-{self._generations.get(key, 0)}"
        plan = weights_pb2.WeightSyncPlan(
            sync_id=sync_id, weight_version=prepared.weight_version, group_id=group_id,
            rendezvous_host=prepared.rendezvous_host, rendezvous_port=prepared.rendezvous_port,
            world_size=len(members) + 1, source=prepared.source, manifest=prepared.manifest,
            sync_key=secrets.token_bytes(32),   # per sync: keys the rendezvous and the sender's manifest tag
            backend=weights_pb2.PROCESS_GROUP_BACKEND_NCCL if self.backend == "nccl"
            else weights_pb2.PROCESS_GROUP_BACKEND_GLOO,
            members=[rank0] + [
                weights_pb2.WeightSyncMember(rank=i + 1, replica_id=r, address=self.registry.get(r).address)
                for i, r in enumerate(members)])
        plan.timeout.CopyFrom(duration(timeout_s))
        return plan

    async def push_versions(self, results: list[ReplicaSyncOutcome], version: int) -> None:
        """Tell the balancers the new versions; a replica whose sync failed is stale, one that synced is not.

        A stale replica leaves routing until a later sync succeeds (the rule of
        :mod:`controller.routing`); the routing of the replicas whose staleness
        changed converges now. One still in its transition (a serving sync holds
        it SYNCING until this returns, an activation wakes it after) is routed
        by that transition or by the next routing reconcile round.
        """
        stale = self.routing.stale
        done = {r.replica_id: version for r in results if r.ok}
        failed = [r.replica_id for r in results if not r.ok]
        recovered = [r for r in done if r in stale]
        stale.difference_update(done)   # at the current version now, whatever its state
        stale.update(failed)
        try:
            await self.routing.converge(failed)
            await self.routing.update_versions(done)
            await self.routing.converge(recovered)
        except grpc.aio.AioRpcError as err:
            log.warning("could not update the load balancer after sync: %s", describe_error(err))

    @staticmethod
    def _all_failed(replica_ids: Sequence[str], version: int, sync_id: str, why: str,
                    started: float) -> WeightSyncOutcome:
        return WeightSyncOutcome(weight_version=version, sync_id=sync_id, duration_s=time.monotonic() - started,
                                 replica_results=tuple(ReplicaSyncOutcome(r, False, why) for r in replica_ids))


def _unavailable(task: asyncio.Future) -> bool:
    """Whether a finished call failed with UNAVAILABLE (its agent cannot be reached)."""
    err = None if task.cancelled() else task.exception()
    return isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE
