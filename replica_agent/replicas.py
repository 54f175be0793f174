"""The engine replicas of one node and every transition they go through.

:class:`ReplicaManager` owns the slots of the node and one :class:`Replica`
per launched engine. Each replica has exactly one state (the
``rollmesh.common.v1.ReplicaState`` names): the agent's own phases
(LAUNCHING, SYNCING, STOPPED, FAILED) take precedence over the engine's
(LOADING, ACTIVE, PAUSED, SLEEPING). Lifecycle calls on one replica are
serialised by its lock; while one runs, the replica takes no new requests.
Engine exceptions are mesh errors already (their canonical codes are theirs) and pass through.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar
from dataclasses import dataclass, field

from mesh_runtime import errors
from mesh_runtime.durations import set_seconds
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import types_pb2

from . import convert
from .engines import Engine, EngineError, EngineState, GenerationChunk, EngineRequest, PauseMode

if TYPE_CHECKING:
    from rollmesh.replica.v1 import replica_pb2

log = logging.getLogger(__name__)

SERVING = "ACTIVE"
_ENGINE_STATES = {
    EngineState.LOADING: "LOADING", EngineState.ACTIVE: "ACTIVE", EngineState.PAUSED: "PAUSED",
    EngineState.SLEEPING: "SLEEPING", EngineState.AWAITING_WEIGHTS: "SLEEPING",
    EngineState.CLOSED: "STOPPED", EngineState.DEAD: "FAILED",
}


@dataclass
class Replica:
    """One engine replica on this node."""

    replica_id: str
    kind: str
    slots: list[int]
    memory_fraction: float
    initial: bool
    engine: Engine
    engine_url: str = ""
    """The running engine server the replica is attached to; empty when this agent runs the engine."""
    launched_at: float = field(default_factory=time.time)
    phase: str | None = "LAUNCHING"
    """The agent's own phase (LAUNCHING, SYNCING, STOPPED, FAILED); None = the engine's state."""
    reason: str = ""
    sleep_level: int = 0
    weights_discarded: bool = False
    in_flight: set[str] = field(default_factory=set)
    busy: str = ""
    """Name of the lifecycle call in progress; new requests are refused meanwhile (a weight sync of a serving
    replica: they wait for it, see ``sync_wait_s``)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    """Clear while a weight sync of a serving replica runs."""
    serving_through_sync: bool = False

    @property
    def state(self) -> str:
        if self.phase is not None:
            return self.phase
        return _ENGINE_STATES[self.engine.state]

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def awake(self) -> bool:
        return self.state in ("ACTIVE", "PAUSED")

    def to_proto(self, *, node_id: str, address: str, backend: str, model: str) -> replica_pb2.Replica:
        """The wire form."""
        from rollmesh.replica.v1 import replica_pb2  # noqa: PLC0415 - keep the module import light

        msg = replica_pb2.Replica(
            replica_id=self.replica_id, node_id=node_id, kind=convert.KINDS[self.kind],
            state=convert.state_enum(self.state), weight_version=self.weight_version, slots=self.slots,
            memory_fraction=self.memory_fraction, backend=convert.BACKENDS[backend], model=model, address=address,
            initial=self.initial, state_reason=self.reason, in_flight_requests=len(self.in_flight),
            engine_url=self.engine_url,
            sleep_level=types_pb2.SleepLevel.Value(f"SLEEP_LEVEL_{self.sleep_level}")
            if self.state == "SLEEPING" and self.sleep_level else types_pb2.SLEEP_LEVEL_UNSPECIFIED)
        set_seconds(msg.launched_at, self.launched_at)
        return msg


def check_launch(*, kind: str, slots: int, engine_url: str, memory_fraction: float | None) -> None:
    """INVALID_ARGUMENT for a launch that no node could carry out."""
    if kind not in ("STANDALONE", "HYBRID"):
        raise errors.InvalidArgument("kind must be STANDALONE or HYBRID", reason=Reason.INVALID_KIND)
    if engine_url and slots != 0:
        raise errors.InvalidArgument(f"a replica attached to {engine_url[:80]} uses no slot of this node; "
                                     f"slots must be 0, got {slots}", reason=Reason.INVALID_SLOTS)
    if not engine_url and slots < 1:
        raise errors.InvalidArgument(f"slots must be >= 1, got {slots}", reason=Reason.INVALID_SLOTS)
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise errors.InvalidArgument(f"memory_fraction must be in (0, 1], got {memory_fraction}",
                                     reason=Reason.INVALID_MEMORY_FRACTION)


class _Held(Protocol):
    replica_id: str
    kind: str

    @property
    def state(self) -> str: ...


def reserve_slots(node_id: str, replica_id: str, existing: _Held | None, slots: int,
                  slots_total: int,
                  owners: dict[int, str]) -> list[int]:
    """Take ``slots`` free slots of the node for ``replica_id`` (recorded in ``owners``): ALREADY_EXISTS while
    ``existing`` (the replica of that id) is neither STOPPED nor FAILED, RESOURCE_EXHAUSTED when too few are
    free."""
    if existing is not None and existing.state not in ("STOPPED", "FAILED"):
        raise errors.AlreadyExists(f"replica {replica_id!r} already exists on this node ({existing.state})",
                                   reason=Reason.REPLICA_EXISTS)
    free = [s for s in range(slots_total) if s not in owners]
    if slots > len(free):
        raise errors.ResourceExhausted(f"replica {replica_id!r} needs {slots} slot(s) but node {node_id!r} has "
                                       f"{len(free)} of {slots_total} free", reason=Reason.NO_FREE_SLOTS)
    for slot in free[:slots]:
        owners[slot] = replica_id
    return free[:slots]


EngineFactory = Callable[..., Engine]
"""(replica_id, kind, memory_fraction, weight_version, engine_url=...) -> an engine not started yet."""


H = TypeVar("H", bound=_Held)


class ReplicaIndex(Generic[H]):
    """The replicas a node holds, by id, and its slots: the lookups every holder of replicas answers the same
    way (this module's in-process replicas, :mod:`replica_agent.processes`' replica processes)."""

    node_id: str
    slots_total: int
    _replicas: dict[str, H]
    _slot_owner: dict[int, str]

    def get(self, replica_id: str) -> H:
        if not replica_id:
            raise errors.InvalidArgument("replica_id must not be empty", reason=Reason.EMPTY_REPLICA_ID)
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise errors.NotFound(f"no replica {replica_id[:80]!r} on node {self.node_id!r} "
                                  f"(it has: {', '.join(sorted(self._replicas)) or 'none'})",
                                  reason=Reason.REPLICA_NOT_FOUND, metadata={"replica_id": replica_id[:80]})
        return replica

    def get_many(self, replica_ids: Iterable[str]) -> list[H]:
        """The named replicas (all when none are named); NOT_FOUND before any change."""
        ids = list(replica_ids)
        return [self.get(i) for i in ids] if ids else list(self._replicas.values())

    def list(self, kinds: Iterable[str] = (), states: Iterable[str] = ()) -> builtins.list[H]:
        kinds, states = set(kinds), set(states)
        return [r for r in self._replicas.values()
                if (not kinds or r.kind in kinds) and (not states or r.state in states)]

    @property
    def slots_free(self) -> int:
        return self.slots_total - len(self._slot_owner)


class ReplicaManager(ReplicaIndex[Replica]):
    """Launches, serves, sleeps, wakes and stops the replicas of one node."""

    def __init__(self, *, node_id: str, slots_total: int, engine_factory: EngineFactory,
                 default_memory_fraction: Callable[[str], float], max_waiting_requests: int,
                 sync_wait_s: float = 0.0) -> None:
        self.node_id = node_id
        self._sync_wait_s = sync_wait_s
        self.slots_total = slots_total
        self._factory = engine_factory
        self._default_fraction = default_memory_fraction
        self._max_waiting = max_waiting_requests
        self._replicas: dict[str, Replica] = {}
        self._slot_owner: dict[int, str] = {}
        self._launch_lock = asyncio.Lock()

    # --------------------------------------------------------------- lifecycle
    async def launch(self, *, replica_id: str, kind: str, slots: int, memory_fraction: float | None = None,
                     start_asleep: bool = False, weight_version: int = 0, initial: bool = False,
                     engine_url: str = "") -> Replica:
        """Reserve slots, start an engine (or attach to the engine server at ``engine_url``, which takes no
        slot) and (optionally) put it to sleep."""
        check_launch(kind=kind, slots=slots, engine_url=engine_url, memory_fraction=memory_fraction)
        async with self._launch_lock:
            free = reserve_slots(self.node_id, replica_id, self._replicas.get(replica_id), slots,
                                 self.slots_total, self._slot_owner)
            fraction = memory_fraction if memory_fraction is not None else self._default_fraction(kind)
            try:
                engine = (self._factory(replica_id, kind, fraction, weight_version, engine_url=engine_url)
                          if engine_url else self._factory(replica_id, kind, fraction, weight_version))
            except BaseException:
                for slot in free:
                    del self._slot_owner[slot]
                raise
            replica = Replica(replica_id, kind, free, fraction, initial, engine, engine_url=engine_url)
            self._replicas[replica_id] = replica
        async with replica.lock:
            replica.busy = "launch"
            try:
                replica.phase = None  # LOADING, from the engine
                await engine.start()
                if start_asleep:
                    await engine.sleep(1)
                    replica.sleep_level = 1
            except Exception as exc:
                self._fail(replica, f"launch failed: {exc}")
                with contextlib.suppress(Exception):
                    await engine.close()
                if isinstance(exc, EngineError):
                    raise
                raise errors.Internal(f"replica {replica_id!r} failed to start: {exc}") from exc
            finally:
                replica.busy = ""
        log.info("replica %s (%s) launched on slots %s: %s", replica_id, kind, replica.slots, replica.state)
        return replica

    def _release_slots(self, replica: Replica) -> None:
        for slot in replica.slots:
            if self._slot_owner.get(slot) == replica.replica_id:
                del self._slot_owner[slot]

    def _fail(self, replica: Replica, reason: str) -> None:
        log.warning("replica %s: %s -> FAILED (%s)", replica.replica_id, replica.state, reason,
                    extra={"replica_id": replica.replica_id})
        replica.phase, replica.reason = "FAILED", reason
        self._release_slots(replica)

    @contextlib.contextmanager
    def _logged(self, replicas: Iterable[Replica], why: str) -> Iterator[None]:
        """Log each replica whose state the block changed: ``replica ID: FROM -> TO (why)``."""
        replicas = list(replicas)
        before = [r.state for r in replicas]
        try:
            yield
        finally:
            for replica, state in zip(replicas, before):
                if replica.state != state:
                    log.info("replica %s: %s -> %s (%s)", replica.replica_id, state, replica.state, why,
                             extra={"replica_id": replica.replica_id})

    async def stop(self, replica_id: str, *, grace_s: float, force: bool) -> Replica:
        """Drain (unless ``force``) for up to ``grace_s``, abort the rest, close, free slots."""
        replica = self.get(replica_id)
        if replica.state == "STOPPED":
            return replica
        async with replica.lock:
            with self._logged([replica], "stop" + (" (forced)" if force else "")):
                replica.busy = "stop"
                try:
                    if not force and replica.awake and replica.in_flight:
                        with contextlib.suppress(asyncio.TimeoutError, EngineError):
                            await asyncio.wait_for(replica.engine.pause("wait"), timeout=grace_s)
                    with contextlib.suppress(EngineError):
                        await replica.engine.abort(None)
                    await replica.engine.close()
                finally:
                    replica.busy = ""
                    replica.phase, replica.reason = "STOPPED", "stopped" + (" (forced)" if force else "")
                    self._release_slots(replica)
        return replica

    async def close(self) -> None:
        for replica in list(self._replicas.values()):
            if replica.state != "STOPPED":
                with contextlib.suppress(Exception):
                    await self.stop(replica.replica_id, grace_s=0.0, force=True)

    # -------------------------------------------------------------- generation
    def _refusal(self, replica: Replica) -> str | None:
        if replica.busy:
            return f"replica {replica.replica_id!r} is busy ({replica.busy} in progress)"
        if replica.state != SERVING:
            why = f" ({replica.reason})" if replica.reason else ""
            return f"replica {replica.replica_id!r} is {replica.state}{why}, not ACTIVE"
        return None

    async def generate(self, replica_id: str, request: EngineRequest) -> AsyncIterator[GenerationChunk]:
        """Stream a generation on one replica; refused with UNAVAILABLE unless it is ACTIVE."""
        replica = self.get(replica_id)
        refusal = self._refusal(replica)
        if refusal and replica.serving_through_sync and self._sync_wait_s > 0:
            # a serving replica taking new weights: wait for them (the request then runs on them) rather than
            # send the caller elsewhere, where the other replicas are usually syncing too
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.synced.wait(), self._sync_wait_s)
            refusal = self._refusal(replica)
        if refusal:
            raise errors.Unavailable(refusal, reason=Reason.REPLICA_NOT_SERVING,
                                     metadata={"replica_id": replica_id, "state": replica.state})
        if request.request_id in replica.in_flight:
            raise errors.AlreadyExists(f"request {request.request_id!r} is already in flight on replica "
                                       f"{replica_id!r}", reason=Reason.REQUEST_IN_FLIGHT)
        if replica.engine.load_snapshot().waiting >= self._max_waiting:
            raise errors.ResourceExhausted(f"replica {replica_id!r} already has {self._max_waiting} waiting "
                                           "requests", reason=Reason.QUEUE_FULL)
        replica.in_flight.add(request.request_id)
        try:
            async for chunk in replica.engine.generate(request):
                yield chunk
        except errors.Internal:
            if replica.engine.state == EngineState.DEAD:
                self._fail(replica, "engine died")
            raise
        finally:
            replica.in_flight.discard(request.request_id)

    async def abort(self, replica_id: str, request_ids: Sequence[str] | None) -> builtins.list[str]:
        """Abort requests on one replica (or every replica when ``replica_id`` is empty)."""
        targets = [self.get(replica_id)] if replica_id else list(self._replicas.values())
        aborted: list[str] = []
        for replica in targets:
            if replica.state in ("STOPPED", "FAILED"):
                continue
            aborted += await replica.engine.abort(None if request_ids is None else list(request_ids))
        return aborted

    async def close_session(self, replica_id: str, session_id: str) -> bool:
        """Tell one replica's engine that a session ended; whether it released anything."""
        replica = self.get(replica_id)
        if replica.state in ("STOPPED", "FAILED"):
            return False
        return await replica.engine.close_session(session_id)

    async def flush_cache(self, replica_ids: Sequence[str]) -> builtins.list[str]:
        """Flush the named replicas' prefix caches (every ACTIVE or PAUSED one when none is named); the ids
        flushed. An engine that cannot flush now raises ``CacheInUse`` (those before it are flushed)."""
        replicas = self.get_many(replica_ids) if replica_ids else self.list(states=("ACTIVE", "PAUSED"))
        for replica in replicas:
            if replica.state not in ("ACTIVE", "PAUSED"):
                raise errors.FailedPrecondition(f"replica {replica.replica_id!r} is {replica.state}; only ACTIVE or "
                                                "PAUSED replicas have a cache to flush",
                                                reason=Reason.WRONG_REPLICA_STATE)
        flushed = []
        for replica in replicas:
            await replica.engine.flush_cache()
            flushed.append(replica.replica_id)
        return flushed

    async def pause(self, replica_ids: Sequence[str], *, mode: PauseMode,
                    timeout_s: float | None) -> builtins.list[str]:
        """Pause replicas; returns the ids of requests aborted (``mode='abort'``)."""
        replicas = self.get_many(replica_ids)
        for replica in replicas:
            if replica.state not in ("ACTIVE", "PAUSED") or replica.busy:
                raise errors.FailedPrecondition(
                    f"replica {replica.replica_id!r} is {replica.busy or replica.state}; only ACTIVE or PAUSED "
                    "replicas can be paused", reason=Reason.WRONG_REPLICA_STATE)
        aborted: list[str] = []
        for replica in replicas:
            before = set(replica.in_flight)
            with self._logged([replica], f"pause, mode {mode}"):
                try:
                    await asyncio.wait_for(replica.engine.pause(mode), timeout=timeout_s)
                except asyncio.TimeoutError:
                    raise errors.DeadlineExceeded(
                        f"replica {replica.replica_id!r} still has {len(replica.in_flight)} request(s) in "
                        f"flight after {timeout_s:.1f} s; it stays PAUSED and they keep running",
                        reason=Reason.DRAIN_TIMEOUT) from None
            if mode == "abort":
                aborted += sorted(before)
        return aborted

    async def resume(self, replica_ids: Sequence[str]) -> builtins.list[Replica]:
        replicas = self.get_many(replica_ids)
        for replica in replicas:
            if replica.state not in ("ACTIVE", "PAUSED") or replica.busy:
                raise errors.FailedPrecondition(
                    f"replica {replica.replica_id!r} is {replica.busy or replica.state}; wake it up first"
                    if replica.state == "SLEEPING" else
                    f"replica {replica.replica_id!r} is {replica.busy or replica.state}; only PAUSED or ACTIVE "
                    "replicas can be resumed", reason=Reason.WRONG_REPLICA_STATE)
        for replica in replicas:
            with self._logged([replica], "resume"):
                await replica.engine.resume()
        return replicas

    async def sleep(self, replica_id: str, *, level: int, abort_in_flight: bool) -> int:
        """Release the replica's memory (level 1: offload weights; 2: discard); bytes freed."""
        if level not in (1, 2):
            raise errors.InvalidArgument("level must be SLEEP_LEVEL_1 or SLEEP_LEVEL_2", reason=Reason.INVALID_LEVEL)
        replica = self.get(replica_id)
        async with replica.lock:
            if replica.state not in ("ACTIVE", "PAUSED", "SLEEPING"):
                raise errors.FailedPrecondition(f"replica {replica_id!r} is {replica.state} and cannot sleep",
                                                reason=Reason.WRONG_REPLICA_STATE)
            if replica.in_flight and not abort_in_flight:
                raise errors.FailedPrecondition(
                    f"replica {replica_id!r} has {len(replica.in_flight)} request(s) in flight; abort them "
                    "first or set abort_in_flight", reason=Reason.REQUESTS_IN_FLIGHT)
            replica.busy = "sleep"
            try:
                with self._logged([replica], f"sleep level {level}"):
                    freed = await replica.engine.sleep(level)
            finally:
                replica.busy = ""
            replica.sleep_level = max(replica.sleep_level, level)
            replica.weights_discarded = replica.weights_discarded or level == 2
            return freed

    async def wake(self, replica_id: str, *, tags: set[str], resume_generation: bool) -> Replica:
        """Restore memory (``tags`` of weights, kv_cache; empty = both); PAUSED unless resumed."""
        replica = self.get(replica_id)
        tags = tags or {"weights", "kv_cache"}
        async with replica.lock:
            state = replica.state
            if state not in ("SLEEPING", "PAUSED", "ACTIVE"):
                raise errors.FailedPrecondition(f"replica {replica_id!r} is {state} and cannot be woken",
                                                reason=Reason.WRONG_REPLICA_STATE)
            if state != "SLEEPING":
                return replica
            if replica.weights_discarded and "weights" in tags:
                raise errors.FailedPrecondition(
                    f"replica {replica_id!r} slept at level 2 and has received no weights since; call "
                    "ReceiveWeights first, or wake WAKE_TAG_KV_CACHE alone", reason=Reason.WEIGHTS_DISCARDED)
            replica.busy = "wake"
            try:
                with self._logged([replica], f"wake {', '.join(sorted(tags))}"):
                    await replica.engine.wake_up(tags)
                    if _ENGINE_STATES[replica.engine.state] == "ACTIVE":
                        replica.sleep_level = 0
                        if not resume_generation:
                            await replica.engine.pause("wait")
            finally:
                replica.busy = ""
        return replica
