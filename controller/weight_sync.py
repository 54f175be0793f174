"""``WeightBroadcast``: the controller's weight-sync coordinator (the core's ``WeightSyncPort`` over gRPC).

A weight sync: the source prepares the version (manifest + rendezvous), then
the source's SendWeights and every node's ReceiveWeights run concurrently
under one plan, and the replicas' new versions are pushed to the balancer.

Which replica gets which copy (the registry knows each replica's version):

- the replicas at the *base* version (the newest one below it, which the
  trainer keeps; a hybrid replica asleep at it included) get the new
  version from the trainer as a delta from it, when the trainer offers one
  (``weight_transfer.delta_max_ratio`` on the trainer agent);
- the replicas further behind get a delta from the version they hold where the trainer still has the way
  there (its kept deltas, composed: :mod:`controller.delta_catch_up`);
- the others (a restart, a rollback, a version too old) and any that turn out not to hold their base get a
  full copy from a peer that now holds the version, on their node first; the trainer sends the full copy
  only when no peer can;
- without a delta everyone gets one full broadcast from the trainer.

Replicas a scale-out adds (``sync_new_replicas``) get a full copy from
healthy peers already at the version, on their node first, else from the
trainer (``scale_out_weight_source``).

Many full copies fan out as a tree of chains, one copy into each node
(:mod:`controller.copy_tree`); the replicas done become sources for any left.
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

from . import copy_tree, delta_catch_up
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
    prepare: Callable[[int, int], Awaitable]
    """(version, delta base version or 0) -> PrepareWeightSyncResponse."""
    send: Callable[[weights_pb2.WeightSyncPlan], Awaitable]
    rank0: weights_pb2.WeightSyncMember
    copy: str = "full"
    """What a receiver of a full plan from this source records: ``full`` (the trainer) or ``peer``."""


class WeightBroadcast:
    """``WeightSyncPort``: rank 0 broadcasts to the replicas over one process group.

    Rank 0 is the trainer (``sync``), or for replicas a scale-out adds, the
    trainer or a healthy replica already at the version (``sync_new_replicas``,
    the replica agent's PrepareWeightSync and SendWeights).
    """

    def __init__(self, channels: Channels, registry: ReplicaRegistry, routing: Routing, *,
                 trainer_address: str, timeout_s: float, backend: str = "gloo", bucket_size_bytes: int = 0,
                 peer_copy_sources: int = 4) -> None:
        self.channels = channels
        self.registry = registry
        self.routing = routing
        self.trainer_address = trainer_address
        """The trainer agent configured at start; empty: none."""
        self.named_source = ""
        """The weight source the last sync that named one used (a trainer process serving its own weights):
        the trainer of the syncs that name none while no trainer agent is configured."""
        self.timeout_s = timeout_s
        self.backend = backend
        self.bucket_size_bytes = bucket_size_bytes
        self.peer_copy_sources = peer_copy_sources
        """Peers that send full copies at once (``peer_copy_sources``)."""
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
                   timeout_s: float | None = None, source_address: str = "") -> WeightSyncOutcome:
        """Broadcast ``version`` from the trainer; ``timeout_s`` overrides the configured bound.

        ``source_address``: the trainer's WeightSourceService for this sync (a trainer process that serves its
        own weights says where it is with each sync), and for the syncs that name none while no trainer agent
        is configured; empty: :meth:`trainer`.
        """
        if source_address and source_address != self.named_source:
            log.info("weight source named by the trainer: %s (was %s)", source_address, self.named_source or "none")
            self.named_source = source_address
        self.in_progress += 1
        try:
            return await self._sync(replica_ids, version, timeout_s or self.timeout_s,
                                    source_address or self.trainer())
        finally:
            self._done()

    async def sync_new_replicas(self, replica_ids: Sequence[str], version: int, *, seeds: Sequence[str],
                                source: str = "auto") -> WeightSyncOutcome:
        """Bring new replicas to ``version`` from a seed replica already at it or from the trainer.

        ``source``: ``trainer`` (the trainer only), ``replica`` (a seed only) or
        ``auto`` (a seed when one prepares, else the trainer, so joins leave the
        trainer to the training steps' syncs). The copies fan out from the
        seeds as :meth:`_peer_copies` says (a seed on a new replica's node
        first); a seed that cannot prepare has moved no byte, so another is
        safe to try. With ``auto``, the replicas no seed reached take one
        broadcast from the trainer.
        """
        self.in_progress += 1
        try:
            return await self._full_copies(replica_ids, version, seeds, self.trainer(),
                                           use_seeds=source in ("replica", "auto"),
                                           use_trainer=source in ("trainer", "auto"), timeout_s=self.timeout_s)
        finally:
            self._done()

    def trainer(self) -> str:
        """The trainer's weight source: the trainer agent configured, else the source the last sync named."""
        return self.trainer_address or self.named_source

    async def _full_copies(self, replica_ids: Sequence[str], version: int, seeds: Sequence[str], trainer: str, *,
                           use_seeds: bool, use_trainer: bool, timeout_s: float) -> WeightSyncOutcome:
        """Full copies of ``version``: from peers that hold it (``seeds``, then the replicas done; see
        :meth:`_peer_copies`), and what they could not deliver from the trainer, in one broadcast."""
        started, errors = time.monotonic(), []
        results: dict[str, ReplicaSyncOutcome] = {}
        outcomes: list[WeightSyncOutcome] = []
        pending = list(replica_ids)
        if use_seeds:
            if not seeds:
                errors.append(f"no healthy replica at weight version {version} to seed from")
            pending = await self._peer_copies(pending, version, list(seeds), timeout_s, results, outcomes, errors)
        if pending and use_trainer:
            if not trainer:
                errors.append("no trainer_address configured")
            else:
                outcome, prepare_error = await self._broadcast(pending, version,
                                                               self._trainer_source(trainer, timeout_s), timeout_s)
                if prepare_error:
                    errors.append(prepare_error)
                else:
                    outcomes.append(outcome)
                    results.update((r.replica_id, r) for r in outcome.replica_results)
        why = "no weight source: " + "; ".join(errors)
        for replica_id in replica_ids:   # a failed copy's own answer stands; never tried: no source
            results.setdefault(replica_id, ReplicaSyncOutcome(replica_id, False, why))
        senders = list(dict.fromkeys(r.source for r in results.values() if r.ok and r.source))
        return WeightSyncOutcome(
            weight_version=version, replica_results=tuple(results[r] for r in replica_ids),
            bytes_sent=sum(o.bytes_sent for o in outcomes), duration_s=time.monotonic() - started,
            sync_id=outcomes[0].sync_id if outcomes else f"sync-{version}-{uuid.uuid4().hex[:8]}",
            full_bytes=max((o.full_bytes for o in outcomes), default=0),
            source=", ".join(senders) or (outcomes[-1].source if outcomes else "trainer"))

    async def _peer_copies(self, pending: list[str], version: int, holders: list[str], timeout_s: float,
                           results: dict[str, ReplicaSyncOutcome], outcomes: list[WeightSyncOutcome],
                           errors: list[str]) -> list[str]:
        """Copy ``version`` from ``holders`` (replicas at it) to ``pending`` in rounds; the replicas left.

        Each round runs the chains :func:`copy_tree.shares` plans, all at once.
        The replicas that got their copy are sources in later rounds. A holder
        that cannot prepare (it moved no byte) or whose copy reached none of
        its chain (it died mid-copy) is dropped, and its chain goes to the
        others. In a chain that some got, the first member to fail has failed;
        the members after it (a relay that dies takes the chain below it
        along) are tried once more.
        """
        retried: set[str] = set()
        while pending and holders:
            shares = copy_tree.shares(pending, holders, self._node, self.peer_copy_sources)
            runs = await asyncio.gather(*(self._broadcast(share, version, self._replica_source(seed), timeout_s)
                                          for seed, share in shares))
            pending = []
            for (seed, share), (outcome, prepare_error) in zip(shares, runs, strict=True):
                if prepare_error:
                    errors.append(prepare_error)
                    holders.remove(seed)
                    pending += share
                    continue
                outcomes.append(outcome)
                results.update((r.replica_id, r) for r in outcome.replica_results)
                got = [r for r in share if results[r].ok]
                if not got:
                    errors.append(f"seed replica {seed} sent no copy: "
                                  f"{next(iter(outcome.failed.values()), 'no replica received it')}")
                    log.warning("weight sync of %s to version %d: %s; trying another source", share, version,
                                errors[-1])
                    holders.remove(seed)
                    pending += share
                    continue
                holders += got
                again = [r for r in copy_tree.ranked(share, seed, self._node) if not results[r].ok][1:]   # below it
                pending += [r for r in again if r not in retried]
                retried.update(again)
                if again:
                    log.warning("weight sync to version %d: %s failed below a relay that failed; trying them once "
                                "more", version, again)
        return pending

    def _node(self, replica_id: str) -> str | None:
        """The node of a replica the registry knows; None for any other member (the trainer)."""
        return self.registry.get(replica_id).node_id if replica_id in self.registry else None

    def _done(self) -> None:
        self.in_progress -= 1
        if not self.in_progress and self._idle is not None:
            self._idle.set()
            self._idle = None

    async def _sync(self, replica_ids: Sequence[str], version: int, timeout_s: float,
                    trainer: str) -> WeightSyncOutcome:
        started = time.monotonic()
        if not trainer:
            return self._all_failed(replica_ids, version, f"sync-{version}-{uuid.uuid4().hex[:8]}",
                                    "no trainer_address configured", started)
        source = self._trainer_source(trainer, timeout_s)
        base = self._delta_base(replica_ids, version)
        if base is None or not await self._offers_delta(source, version, base):
            # everyone takes one full broadcast (asked with the base, the answer already given is reused)
            outcome, _ = await self._broadcast(replica_ids, version, source, timeout_s, delta_base=base or 0,
                                               full=True)
            return dataclasses.replace(outcome, duration_s=time.monotonic() - started)
        at_base = [r for r in replica_ids if self.registry.get(r).weight_version == base]
        behind = [r for r in replica_ids if r not in at_base]
        outcome, why = await self._broadcast(at_base, version, source, timeout_s, delta_base=base)
        if why:
            return dataclasses.replace(outcome, replica_results=(
                *outcome.replica_results, *self._all_failed(behind, version, outcome.sync_id, why,
                                                            started).replica_results))
        missing = [r.replica_id for r in outcome.replica_results if r.delta_base_missing]
        older, behind = await delta_catch_up.catch_up(
            behind, lambda r: self.registry.get(r).weight_version, lambda b: self._offers_delta(source, version, b),
            lambda ids, b: self._broadcast(ids, version, source, timeout_s, delta_base=b))
        need_full = behind + missing
        took = [[r.replica_id for r in o.replica_results if r.ok] for o in (outcome, *older)]
        seeds = [replica_id for group in took for replica_id in group]
        log.info("weight sync to version %d: %d replica(s) took the delta from %d, %d one from an older version; "
                 "%s need full copies", version, len(took[0]), base, len(seeds) - len(took[0]), need_full)
        full = await self._full_copies(need_full, version, seeds, trainer, use_seeds=True, use_trainer=True,
                                       timeout_s=timeout_s) if need_full else None
        done = (outcome, *older, *([full] if full else []))
        return dataclasses.replace(outcome, replica_results=tuple(
            r for o in done for r in o.replica_results if o is full or r.replica_id not in need_full),
            bytes_sent=sum(o.bytes_sent for o in done), duration_s=time.monotonic() - started)

    @staticmethod
    async def _offers_delta(source: _Source, version: int, base: int) -> bool:
        """Whether ``source`` prepares ``version`` with a delta from ``base`` (the broadcast that follows asks
        again and gets the same, recorded preparation; an error there is reported there)."""
        try:
            answer = await source.prepare(version, base)
            return answer.HasField("delta") and answer.delta.base_version == base
        except grpc.aio.AioRpcError:
            return False

    def _delta_base(self, replica_ids: Sequence[str], version: int) -> int | None:
        """The newest version below ``version`` that one of ``replica_ids`` holds (asleep or not): the last one
        synced, which the trainer keeps as its delta base; None when there is none."""
        held = [record.weight_version for record in map(self.registry.get, replica_ids)
                if 0 < record.weight_version < version]
        return max(held, default=None)

    def _trainer_source(self, address: str, timeout_s: float | None = None) -> _Source:
        return self._source("trainer", address, "", weights_pb2.WeightSyncMember(rank=0),
                            timeout_s or self.timeout_s)

    def _replica_source(self, seed: str) -> _Source:
        address = self.registry.get(seed).address
        return dataclasses.replace(
            self._source(f"seed replica {seed}", address, seed,
                         weights_pb2.WeightSyncMember(rank=0, replica_id=seed, address=address), self.timeout_s),
            copy="peer")

    def _source(self, what: str, address: str, source_id: str, member: weights_pb2.WeightSyncMember,
                timeout: float) -> _Source:
        """The WeightSourceService at ``address`` (a trainer agent: ``source_id`` empty; a replica agent: the
        seed replica) as the source of one broadcast."""

        stub = self.channels.weight_source(address)
        answers: dict[tuple[int, int], asyncio.Future] = {}

        def prepare(version: int, delta_base: int) -> Awaitable[weight_source_pb2.PrepareWeightSyncResponse]:
            """One PrepareWeightSync per (version, delta base) for this source's sync: asking whether it offers a
            delta and then broadcasting share the answer."""
            if (version, delta_base) not in answers:
                request = weight_source_pb2.PrepareWeightSyncRequest(source_id=source_id, weight_version=version)
                if delta_base > 0:
                    request.delta_base_version = delta_base
                if self.bucket_size_bytes:
                    request.bucket_size_bytes = self.bucket_size_bytes
                answers[(version, delta_base)] = asyncio.ensure_future(stub.PrepareWeightSync(request,
                                                                                             timeout=timeout))
            return answers[(version, delta_base)]

        return _Source(f"{what} PrepareWeightSync", prepare,
                       lambda plan: stub.SendWeights(weight_source_pb2.SendWeightsRequest(source_id=source_id,
                                                                                          plan=plan),
                                                     timeout=timeout),
                       member)

    async def _broadcast(self, replica_ids: Sequence[str], version: int, source: _Source,
                         timeout_s: float | None = None, delta_base: int = 0,
                         full: bool = False) -> tuple[WeightSyncOutcome, str]:
        """One broadcast from ``source``; the outcome and, when the source could not prepare, why.

        ``delta_base``: ask the source for a delta from that version; every one
        of ``replica_ids`` should hold it (one that does not fails with
        ``delta_base_missing`` and needs a full copy). ``full``: send the full
        weights whatever the answer holds.

        A group needs every member: when a node's agent cannot be reached, the
        others would only wait out the rendezvous. So the first UNAVAILABLE
        ReceiveWeights abandons the attempt at once (the sender and the other
        receivers are cancelled), and the sync is run once more, under a new
        group, without the unreachable nodes; their replicas fail and leave
        routing until a later sync reaches them.
        """
        timeout_s = timeout_s or self.timeout_s
        started = time.monotonic()
        outcome, why, unreachable = await self._attempt(replica_ids, version, source, timeout_s, delta_base, full)
        if unreachable and not why:
            lost = [r for r in replica_ids if self.registry.get(r).address in unreachable]
            rest = [r for r in replica_ids if r not in lost]
            if rest:
                log.warning("weight sync to version %d: agent(s) %s unreachable; syncing the %d other replica(s) "
                            "without them", version, sorted(unreachable), len(rest))
                retry, why, _ = await self._attempt(rest, version, source, timeout_s, delta_base, full)
                failed = [r for r in outcome.replica_results if r.replica_id in lost]
                outcome = dataclasses.replace(retry, replica_results=(*failed, *retry.replica_results),
                                              duration_s=time.monotonic() - started)
        if not why:  # a source that could not prepare moved nothing: the caller may try another
            await self.push_versions(list(outcome.replica_results), version)
        return outcome, why

    async def _attempt(self, replica_ids: Sequence[str], version: int, source: _Source, timeout_s: float,
                       delta_base: int = 0, full: bool = False) -> tuple[WeightSyncOutcome, str, set[str]]:
        """One plan: prepare, then send and receive concurrently.

        Returns the outcome, why the source could not prepare (or ""), and the
        agent addresses that could not be reached.
        """
        sync_id = f"sync-{version}-{uuid.uuid4().hex[:8]}"
        if not replica_ids:
            return WeightSyncOutcome(weight_version=version, sync_id=sync_id), "", set()
        started = time.monotonic()
        try:
            prepared = await source.prepare(version, delta_base)
        except grpc.aio.AioRpcError as err:
            why = f"{source.what}: {describe_error(err)}"
            return self._all_failed(replica_ids, version, sync_id, why, started), why, set()
        if prepared.weight_version != version:
            why = f"{source.what}: prepared weight version {prepared.weight_version}, not {version}"
            return self._all_failed(replica_ids, version, sync_id, why, started), why, set()
        self._model_bytes = prepared.manifest.total_bytes
        plan = self._plan(sync_id, prepared, list(replica_ids), source.rank0, timeout_s)
        delta = prepared.delta if delta_base > 0 and not full and prepared.HasField("delta") else None
        if delta is not None:
            plan.delta.CopyFrom(delta)
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
                results += [ReplicaSyncOutcome(r, False, why, source=prepared.source) for r in ids]
                continue
            for r in task.result().results:
                ok = r.checksum_ok and r.weight_version == version
                why = "" if ok else (r.error_message or "checksum mismatch")
                results.append(ReplicaSyncOutcome(r.replica_id, ok, why, to_seconds(r.duration), r.bytes_received,
                                                  copy="delta" if delta is not None else source.copy,
                                                  source=prepared.source,
                                                  delta_base_missing=r.delta_base_missing))
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
        if delta is not None:
            delta_fields: dict = dict(delta_base_version=delta.base_version, delta_bytes=delta.stream.total_bytes,
                                      delta_density=delta.changed_words / delta.total_words if delta.total_words
                                      else 0.0)
        else:
            delta_fields = {}
        return WeightSyncOutcome(weight_version=version, replica_results=tuple(results), bytes_sent=bytes_sent,
                                 duration_s=time.monotonic() - started, sync_id=sync_id, source=prepared.source,
                                 full_bytes=prepared.manifest.total_bytes, **delta_fields), "", unreachable

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
        members = copy_tree.ranked(replica_ids, rank0.replica_id, self._node)
        key = (prepared.source, *sorted(replica_ids))
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
        # one without the delta's base is neither: its full copy, next, decides
        failed = [r.replica_id for r in results if not r.ok and not r.delta_base_missing]
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
