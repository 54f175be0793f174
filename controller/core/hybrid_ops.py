"""The ordered transitions of hybrid and serving replicas, driven through the ports.

Orders (docs/architecture.md, principle 2), each replica state change through the
registry's state machine:

* deactivate: ``take_out`` (routing first, so retries never land on a
  dying replica) -> ACTIVE/PAUSED to DRAINING -> ``abort`` -> ``sleep`` ->
  SLEEPING.
* activate: SLEEPING to SYNCING -> weight ``sync`` (only replicas behind the
  target version, or all with sleep level 2) -> ``wake`` -> PAUSED ->
  ``bring_in`` -> ``resume`` -> ACTIVE.
* sync of serving replicas: ACTIVE/PAUSED to SYNCING -> ``sync`` -> back to
  the previous state (a replica whose part failed keeps its old version and
  keeps serving; the load balancer's version floors decide whether it may).

A port call failing for some replicas marks exactly those FAILED (with the
reason) and stops them, best effort, so a hybrid replica that failed to sleep
does not keep GPU memory the trainer needs; the other replicas continue.
Every call has a timeout; ``TimeoutError`` counts as a failure of that call.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .config import SchedulingConfig
from .errors import PortDeadlineExceeded, PortUnavailable
from .events import EventSink, EventType
from .ports import Clock, ReplicaCallResult, ReplicaPort, RoutingPort, Tracer, WeightSyncOutcome, WeightSyncPort
from .records import ReplicaRecord, ReplicaState
from .replicas import ReplicaRegistry

_LOST = frozenset({ReplicaState.FAILED, ReplicaState.STOPPED, ReplicaState.REMOVED})

S = ReplicaState


@dataclasses.dataclass(frozen=True)
class DeactivationResult:
    released: tuple[str, ...]
    failed: dict[str, str]
    aborted_requests: int
    duration_s: float


@dataclasses.dataclass(frozen=True)
class ActivationResult:
    activated: tuple[str, ...]
    failed: dict[str, str]
    sync: WeightSyncOutcome | None
    duration_s: float
    error: str = ""
    """Why the activation as a whole was abandoned (replicas put back to sleep); empty otherwise."""


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class HybridOperations:
    """Executes the transition sequences; knows nothing about steps or policies."""

    def __init__(self, config: SchedulingConfig, *, registry: ReplicaRegistry, routing: RoutingPort,
                 replicas: ReplicaPort, weights: WeightSyncPort, clock: Clock, emit: EventSink,
                 tracer: Tracer) -> None:
        self.config = config
        self.registry = registry
        self.routing = routing
        self.replica_port = replicas
        self.weights = weights
        self.clock = clock
        self.emit = emit
        self.tracer = tracer

    # --- deactivation ---

    async def deactivate(self, ids: Sequence[str], *, global_step: int | None) -> DeactivationResult:
        """remove -> abort -> sleep; raises PortUnavailable (nothing changed) if routing fails."""
        start = self.clock()
        ids = list(ids)
        if not ids:
            return DeactivationResult((), {}, 0, 0.0)
        with self.tracer("hybrid.deactivate", replica_ids=ids, global_step=global_step):
            try:
                await self._bounded(self.routing.take_out(ids, why="released for training"))
            except Exception as err:
                raise PortUnavailable(f"the load balancer did not remove hybrid replicas {ids} from "
                                      f"routing ({_describe(err)}); nothing was slept, retry the call") from err
            # an agent that registered again (a controller restart) while the balancer call awaited may report
            # its replica asleep: the release that died with the old leader got that far, so it is released
            asleep = [rid for rid in ids if rid in self.registry and self.registry.get(rid).state is S.SLEEPING]
            ids = [rid for rid in ids if rid not in asleep]
            for rid in ids:
                self._move(rid, S.DRAINING, "removed from routing", global_step)
            failed, aborted = await self._per_node(self.replica_port.abort, ids, "abort")
            await self._fail(failed, global_step)
            rest = [rid for rid in ids if rid not in failed]
            with self.tracer("replica.sleep", replica_ids=rest, level=self.config.sleep_level):
                sleep_failed, _ = await self._per_node(self.replica_port.sleep, rest, "sleep",
                                                       self.config.sleep_level)
            await self._fail(sleep_failed, global_step)
            failed.update(sleep_failed)
            released = tuple(asleep) + tuple(rid for rid in rest if rid not in sleep_failed)
            for rid in released:
                if rid in self.registry and self.registry.get(rid).state in (S.ACTIVE, S.PAUSED):
                    # its agent registered again (a controller restart) while this release awaited it,
                    # reporting the state it had then; it has slept since, so it goes the release's way again
                    self._move(rid, S.DRAINING, "re-registered during its release", global_step)
                self._move(rid, S.SLEEPING, f"released for training (sleep level {self.config.sleep_level})",
                           global_step)
        return DeactivationResult(released, failed, aborted, self.clock() - start)

    # --- activation ---

    async def activate(self, ids: Sequence[str], *, version: int, global_step: int | None) -> ActivationResult:
        """sync -> wake -> add -> resume for sleeping hybrid replicas."""
        start = self.clock()
        failed: dict[str, str] = {}
        sync: WeightSyncOutcome | None = None
        with self.tracer("hybrid.activate", replica_ids=list(ids), weight_version=version,
                         global_step=global_step):
            stale = [rid for rid in ids
                     if self.config.sleep_level == 2 or self.registry.get(rid).weight_version < version]
            if stale:
                for rid in stale:
                    self._move(rid, S.SYNCING, f"weight sync to version {version} before activation",
                               global_step)
                try:
                    sync = await self.sync(stale, version, global_step, role="hybrid")
                except BaseException as err:  # also cancellation: never leave replicas SYNCING
                    message = err.message if isinstance(err, (PortUnavailable, PortDeadlineExceeded)) else (
                        f"interrupted: {_describe(err)}")
                    for rid in stale:
                        self._move(rid, S.SLEEPING, f"hybrid weight sync failed: {message}", global_step)
                    if isinstance(err, (PortUnavailable, PortDeadlineExceeded)):
                        return ActivationResult((), {}, None, self.clock() - start, message)
                    raise
                failed.update(sync.failed)
                await self._fail(sync.failed, global_step)
            awake_candidates = [rid for rid in ids if rid not in failed]
            with self.tracer("replica.wake", replica_ids=awake_candidates):
                wake_failed, _ = await self._per_node(self.replica_port.wake, awake_candidates, "wake")
            await self._fail(wake_failed, global_step)
            failed.update(wake_failed)
            woken = [rid for rid in awake_candidates if rid not in wake_failed]
            for rid in woken:
                self._move(rid, S.PAUSED, "woken up", global_step)
            if not woken:
                return ActivationResult((), failed, sync, self.clock() - start, "no hybrid replica woke up")
            try:
                await self._bounded(self.routing.bring_in(woken))
            except Exception as err:  # noqa: BLE001
                reason = f"the load balancer did not add hybrid replicas ({_describe(err)})"
                await self._put_back_to_sleep(woken, reason, global_step, failed)
                return ActivationResult((), failed, sync, self.clock() - start, reason)
            resume_failed, _ = await self._per_node(self.replica_port.resume, woken, "resume")
            await self._fail(resume_failed, global_step, routed=True)
            failed.update(resume_failed)
            activated = tuple(rid for rid in woken if rid not in resume_failed)
            for rid in activated:
                self._move(rid, S.ACTIVE, "activated for rollout", global_step)
        return ActivationResult(activated, failed, sync, self.clock() - start)

    async def _put_back_to_sleep(self, ids: list[str], reason: str, global_step: int | None,
                                 failed: dict[str, str]) -> None:
        for rid in ids:
            self._move(rid, S.DRAINING, f"activation abandoned: {reason}", global_step)
        sleep_failed, _ = await self._per_node(self.replica_port.sleep, ids, "sleep", self.config.sleep_level)
        await self._fail(sleep_failed, global_step)
        failed.update(sleep_failed)
        for rid in ids:
            if rid not in sleep_failed:
                self._move(rid, S.SLEEPING, f"activation abandoned: {reason}", global_step)

    # --- weight sync ---

    async def sync_serving(self, ids: Sequence[str], version: int, global_step: int | None) -> WeightSyncOutcome:
        """Sync replicas that serve now; they return to their previous state afterwards."""
        previous = {rid: self.registry.get(rid).state for rid in ids}
        for rid in ids:
            self._move(rid, S.SYNCING, f"weight sync to version {version}", global_step)
        try:
            outcome = await self.sync(ids, version, global_step, role="serving")
        except BaseException as err:  # also cancellation: never leave serving replicas SYNCING
            message = err.message if isinstance(err, (PortUnavailable, PortDeadlineExceeded)) else (
                f"interrupted: {_describe(err)}")
            for rid in ids:
                self._move(rid, previous[rid], f"weight sync failed, keeps version "
                           f"{self.registry.get(rid).weight_version}: {message}", global_step)
            raise
        for rid in ids:
            why = outcome.failed.get(rid)
            reason = (f"weight sync failed, keeps version {self.registry.get(rid).weight_version}: {why}"
                      if why else f"synced to version {version}")
            self._move(rid, previous[rid], reason, global_step)
        return outcome

    async def sync(self, ids: Sequence[str], version: int, global_step: int | None, *, role: str) -> WeightSyncOutcome:
        """One broadcast; raises PortDeadlineExceeded / PortUnavailable when it fails as a whole."""
        ids = list(ids)
        self.emit(EventType.WEIGHT_SYNC_STARTED, global_step=global_step, weight_version=version,
                  reason=f"{role} weight sync", attributes={"replicas": len(ids), "role": role})
        start = self.clock()
        with self.tracer("weights.broadcast", replica_ids=ids, weight_version=version, role=role):
            try:
                outcome = await asyncio.wait_for(self.weights.sync(ids, version),
                                                 self.config.weight_sync_timeout_s)
            except TimeoutError as err:
                message = (f"{role} weight sync to version {version} did not finish within "
                           f"weight_sync_timeout_s={self.config.weight_sync_timeout_s}")
                self.emit(EventType.WEIGHT_SYNC_FAILED, global_step=global_step, weight_version=version,
                          reason=message)
                raise PortDeadlineExceeded(message) from err
            except Exception as err:
                message = f"{role} weight sync to version {version} failed: {_describe(err)}"
                self.emit(EventType.WEIGHT_SYNC_FAILED, global_step=global_step, weight_version=version,
                          reason=message)
                raise PortUnavailable(message) from err
        for rid in ids:
            if rid not in outcome.failed:
                self.registry.set_weight_version(rid, version)
        for rid, why in outcome.failed.items():
            self.emit(EventType.WEIGHT_SYNC_FAILED, replica_id=rid, global_step=global_step,
                      weight_version=version, reason=why)
        self.emit(EventType.WEIGHT_SYNC_COMPLETED, global_step=global_step, weight_version=version,
                  reason=f"{role} weight sync", attributes={
                      **outcome.attributes(), "duration_s": outcome.duration_s or self.clock() - start,
                      "replicas": len(ids), "failed": len(outcome.failed), "role": role})
        return outcome

    # --- rebalance ---

    async def rebalance(self, global_step: int | None, *, requested: str = "returned") -> int | None:
        """clear sticky sessions -> rebalance; the requests moved, or None when it failed (reported, not raised).

        ``requested`` says how the policy asked: ``"returned"`` (a truthy
        ``request_rebalance``) or ``"rollouter"`` (verl's
        ``self._rollouter.rebalance_requests.remote()``).
        """
        with self.tracer("hybrid.rebalance", global_step=global_step, requested=requested):
            try:
                await self._bounded(self.routing.clear_sticky())
                moved = await self._bounded(self.routing.rebalance())
            except Exception as err:  # noqa: BLE001
                self.emit(EventType.STEP_PHASE, global_step=global_step,
                          reason=f"rebalance after activation failed: {_describe(err)}",
                          attributes={"phase": "rebalance", "ok": False, "requested": requested})
                return None
        moved = int(moved or 0)
        self.emit(EventType.STEP_PHASE, global_step=global_step,
                  reason=f"rebalance after activation moved {moved} request(s)",
                  attributes={"phase": "rebalance", "ok": True, "moved_requests": moved, "requested": requested})
        return moved

    # --- helpers ---

    async def _bounded(self, awaitable: Awaitable[Any]) -> Any:
        return await asyncio.wait_for(awaitable, self.config.port_timeout_s)

    async def _per_node(self, method: Callable[..., Awaitable[ReplicaCallResult | None]], ids: Sequence[str],
                        action: str, *args: Any) -> tuple[dict[str, str], int]:
        """One call per node, concurrently; returns (failed id -> reason, aborted requests)."""
        groups: dict[str, list[str]] = {}
        for rid in ids:
            groups.setdefault(self.registry.get(rid).node_id, []).append(rid)

        async def call(group: list[str]) -> tuple[dict[str, str], int]:
            try:
                result = await self._bounded(method(group, *args))
            except Exception as err:  # noqa: BLE001 - one node's failure must not stop the others
                return {rid: f"{action} failed: {_describe(err)}" for rid in group}, 0
            if result is None:
                return {}, 0
            return ({rid: f"{action} failed: {why}" for rid, why in result.failed.items() if rid in group},
                    result.aborted_requests)

        failed: dict[str, str] = {}
        aborted = 0
        for group_failed, group_aborted in await asyncio.gather(*(call(g) for g in groups.values())):
            failed.update(group_failed)
            aborted += group_aborted
        return failed, aborted

    async def _fail(self, failures: dict[str, str], global_step: int | None, *, routed: bool = False) -> None:
        """Stop replicas best effort (freeing their memory, dropping routing), then mark them FAILED."""
        if not failures:
            return
        ids = list(failures)
        routing_note = ""
        if routed:
            try:
                await self._bounded(self.routing.take_out(ids, why="failed"))
            except Exception as err:  # noqa: BLE001 - best effort, recorded in the reason
                routing_note = f"; removal from routing failed: {_describe(err)}"
        stop_failed, _ = await self._per_node(self.replica_port.stop, ids, "stop")
        for rid, reason in failures.items():
            suffix = (f"; stop also failed: {stop_failed[rid]}" if rid in stop_failed
                      else "; stopped to free its memory")
            self._move(rid, S.FAILED, reason + routing_note + suffix, global_step)

    def _move(self, rid: str, state: ReplicaState, reason: str, global_step: int | None) -> ReplicaRecord | None:
        """Transition ``rid``, unless the replica was lost while this operation awaited.

        Operations await agents and the balancer between transitions; meanwhile a
        lease may expire (FAILED), a scale-in may remove the replica (REMOVED,
        STOPPED) or its node may be forgotten. That outcome stands: the
        operation does not drag the replica back into its own sequence. Any
        other transition the state machine refuses is a bug and still raises.
        """
        if rid not in self.registry:
            return None
        record = self.registry.get(rid)
        if record.state in _LOST and not self.registry.can_transition(rid, state):
            return record
        return self.registry.transition(rid, state, reason, global_step=global_step)
