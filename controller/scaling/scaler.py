"""Elastic scaling: scale-out and scale-in requests as operations, one at a time, durable.

:class:`Scaler` validates a request, answers the idempotency rules (a target
already met -> NOOP; external addresses already known or in flight are
skipped; a retried ``request_id`` returns its operation), enforces one
operation at a time (ABORTED naming the running one), records the operation
in the controller's store *before* anything changes, and runs it as a task
(:mod:`controller.scale_runs`). Every state change is persisted at once and
is an OPERATION_STATE_CHANGED event.

Cancel stops the task and rolls back what it created. After a controller
restart an operation that was running either resumes (a scale-out already
READY; a scale-in already draining, which finishes its removal) or is rolled
back and ends FAILED with the reason "controller restarted".

Replica counts are per model and count STANDALONE replicas that are not
FAILED, STOPPED or REMOVED, so replicas being created count toward a target.
Hybrid replicas belong to the dynamic-resource scheduler and are never
scaled; scale operations and hybrid transitions take ``Mesh.transitions``
around every change of routing or weights, so they never interleave.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from mesh_runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from mesh_runtime.net import AddressError, parse_host_port
from mesh_runtime.reasons import Reason
from mesh_runtime.validate import check_engine_url, is_engine_url
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from . import runs as scale_runs
from ..agents import AgentCalls
from .operations import TERMINAL, OperationBook, OperationState, OperationType, ScaleOperation, cancellable
from ..core.records import TERMINAL_STATES, ReplicaKind, ReplicaRecord


if TYPE_CHECKING:
    from ..config import ControllerConfig
    from ..core.hybrid import DynamicResourceController
    from ..core.replicas import ReplicaRegistry
    from ..routing import Routing
    from ..store import StateStore
    from ..weight_sync import WeightBroadcast
log = logging.getLogger(__name__)
OS = OperationState


Run = Callable[["Scaler", ScaleOperation], Awaitable[None]]
"""A scale operation's body, or what undoes it (:mod:`controller.scaling.runs`)."""


def check_addresses(addresses: list[str], what: str) -> list[str]:
    """Agent addresses (``HOST:PORT``) and engine server URLs (``http://HOST:PORT``, external SGLang)."""
    addresses = [a.removesuffix("/") if is_engine_url(a) else a for a in addresses]
    for address in addresses:
        if is_engine_url(address):
            check_engine_url(address, what)
            continue
        try:
            parse_host_port(address, allow_zero_port=False)
        except AddressError as err:
            raise InvalidArgument(f"{what}: {address!r} is not HOST:PORT ({err})", reason=Reason.INVALID_ADDRESS,
                                  metadata={"address": address}) from None
    if len(set(addresses)) != len(addresses):
        raise InvalidArgument(f"{what} repeats an address: {addresses}", reason=Reason.REPEATED_ADDRESS)
    return list(addresses)


class Scaler:
    """Scale operations of one controller."""

    def __init__(self, config: ControllerConfig, *, store: StateStore, registry: ReplicaRegistry, routing: Routing,
                 weights: WeightBroadcast, scheduler: DynamicResourceController, transitions: asyncio.Lock,
                 calls: AgentCalls, clock: Callable[[], float], emit: Callable[..., Any],
                 span: Callable[..., AbstractContextManager[Any]],
                 renew: Callable[[str, Any], tuple[float, bool]]) -> None:
        """The controller's parts a scale operation uses, as explicit ports (the :class:`~controller.mesh.Mesh`
        wires them; a test wires fakes): ``calls`` reaches the agents and balancers, ``transitions`` is the one
        lock of routing and weight changes, ``renew`` renews an external node's lease from its reports."""
        self.config = config
        self.store, self.registry, self.routing, self.weights = store, registry, routing, weights
        self.scheduler, self.transitions, self.calls = scheduler, transitions, calls
        self.clock, self.emit, self.span, self.renew = clock, emit, span, renew
        self.book = OperationBook(clock=clock, emit=emit)
        saved = store.load("operations", state_pb2.OperationsDocument)
        if saved is not None:
            self.book.restore(saved)
        store.track("operations", self.book.to_document)
        self.tasks: dict[str, asyncio.Task] = {}
        self.removing: set[str] = set()
        """Replicas a scale-in is taking out: never routed again, even if their agent re-registers."""
        self.on_finished: list[Callable[[ScaleOperation], None]] = []
        self._closing = False
        for op in self.book.list():
            if not op.finished and op.type is OperationType.SCALE_IN and op.state is not OS.PENDING:
                self.removing.update(op.replica_ids)

    # ------------------------------------------------------------ bookkeeping
    async def save(self) -> None:
        """Persist operations and registry before going on: a crash right after must find them. The write runs
        off the event loop (a slow or unreachable store never stalls the controller); when the store refuses
        it, the error ends the caller and the batch is kept for the store's next write."""
        await self.store.commit("operations", "registry/node", "events")

    async def move(self, op: ScaleOperation, state: OperationState, reason: str = "") -> None:
        self.book.transition(op, state, reason, wake=False)
        try:
            await self.save()
        finally:
            self.book.wake()
        self._finished(op)

    def _finished(self, op: ScaleOperation) -> None:
        if op.finished:
            for hook in self.on_finished:
                hook(op)

    def blocks_routing(self, record: ReplicaRecord) -> bool:
        """True while a scale operation owns the replica (removing it, or not yet READY with it)."""
        if record.replica_id in self.removing:
            return True
        op_id = record.added_by_operation_id
        return bool(op_id) and op_id in self.book and not self.book.get(op_id).finished

    def pool(self, model_name: str) -> list[ReplicaRecord]:
        """STANDALONE replicas of the model that count: neither failed, stopped nor removed."""
        return [r for r in self.registry.replicas(kind=ReplicaKind.STANDALONE)
                if r.model_name == model_name and r.state not in TERMINAL_STATES]

    def current_version(self, model_name: str, exclude: AbstractSet[str] = frozenset()) -> int | None:
        """The weight version new replicas must hold: the trainer's latest, or the newest one serving."""
        versions = [r.weight_version for r in self.pool(model_name)
                    if r.replica_id not in exclude and r.state.value == "ACTIVE"]
        candidates = [v for v in (self.scheduler.weight_version, max(versions, default=None)) if v is not None]
        return max(candidates) if candidates else None

    def _timeout(self, given: float | None, default: float) -> float:
        if given is None:
            return default
        if not given > 0:
            raise InvalidArgument(f"timeout must be positive, got {given} s", reason=Reason.INVALID_TIMEOUT)
        return given

    def _spawn(self, op: ScaleOperation, body: Run, undo: Run) -> None:
        task = asyncio.get_running_loop().create_task(self._drive(op, body, undo), name=f"scale-{op.operation_id}")
        self.tasks[op.operation_id] = task

    async def _drive(self, op: ScaleOperation, body: Run, undo: Run) -> None:
        try:
            async with asyncio.timeout(op.timeout_s):
                await body(self, op)
        except asyncio.CancelledError:
            if self._closing:
                raise
            await self._end(op, OS.CANCELLED, "cancelled by user; everything it created was rolled back", undo)
        except TimeoutError:
            await self._end(op, OS.FAILED, f"timed out after {op.timeout_s:g} s in state {op.state.value}", undo)
        except Exception as err:  # noqa: BLE001 - any failure ends the operation FAILED, rolled back
            if not isinstance(err, scale_runs.ScaleFailed):
                log.exception("scale operation %s failed", op.operation_id)
            await self._end(op, OS.FAILED, f"{op.state.value}: {err}", undo)
        finally:
            self.tasks.pop(op.operation_id, None)

    async def _end(self, op: ScaleOperation, state: OperationState, reason: str, undo: Run) -> None:
        try:
            await undo(self, op)
        except Exception:  # noqa: BLE001 - the operation still ends; the log says what was left
            log.exception("rollback of scale operation %s failed", op.operation_id)
        if not op.finished:
            await self.move(op, state, reason)

    # -------------------------------------------------------------- scale-out
    async def scale_out(self, *, model_name: str = "", num_replicas: int = 0, engine_addresses: Sequence[str] = (),
                        timeout_s: float | None = None, request_id: str = "", dry_run: bool = False,
                        policy: str = "", triggered_by: str = "user") -> tuple[ScaleOperation, str]:
        model = model_name or "default"
        addresses = list(engine_addresses)
        if num_replicas < 0:
            raise InvalidArgument(f"num_replicas must be >= 0, got {num_replicas}", reason=Reason.INVALID_TARGET)
        if num_replicas > self.config.max_replicas_per_model:
            raise InvalidArgument(f"num_replicas {num_replicas} is above max_replicas_per_model "
                                  f"({self.config.max_replicas_per_model})", reason=Reason.INVALID_TARGET)
        if bool(num_replicas) == bool(addresses):
            raise InvalidArgument("give either num_replicas > 0 (native mode) or engine_addresses (external "
                                  "mode), not both and not neither", reason=Reason.AMBIGUOUS_SCALE_OUT)
        addresses = check_addresses(addresses, "engine_addresses")
        timeout = self._timeout(timeout_s, self.config.scale_out_timeout)
        policy = policy or self.config.scale_out_partial_success_policy
        fingerprint = json.dumps(["out", model, num_replicas, addresses, timeout_s, policy])
        retried = self.book.by_request_id(request_id, fingerprint)
        if retried is not None and not dry_run:
            return retried, f"retry of request_id {request_id!r}: operation {retried.operation_id}"
        pool = self.pool(model)
        fields: dict[str, Any] = dict(model_name=model, num_replicas=num_replicas, timeout_s=timeout,
                                      partial_success_policy=policy, triggered_by=triggered_by,
                                      request_id=request_id, fingerprint=fingerprint, dry_run=dry_run,
                                      engines_before=len(pool))
        store = not dry_run
        placements: list[str] = []
        if num_replicas:
            if len(pool) >= num_replicas:
                why = (f"{len(pool)} replicas of {model!r} (counting ones being created) already meet the target "
                       f"{num_replicas}")
                return self.book.new(OperationType.SCALE_OUT, state=OS.NOOP, reason=why, store=store, **fields), why
            self.book.check_idle()
            placements = self._placements(model, num_replicas - len(pool))
            message = f"Scale-out request accepted: {len(placements)} new replica(s) on {sorted(set(placements))}"
        else:
            running = self.book.running()
            busy = set(running.engine_addresses) if running and running.type is OperationType.SCALE_OUT else set()
            known = {a for r in self.registry.replicas() if r.state not in TERMINAL_STATES
                     for a in (r.address, r.engine_url) if a}
            fresh = [a for a in addresses if a not in known | busy]
            skipped = [a for a in addresses if a not in fresh]
            if not fresh:
                why = f"every address is already active or being added: {skipped}"
                return (self.book.new(OperationType.SCALE_OUT, state=OS.NOOP, reason=why, store=store,
                                      engine_addresses=addresses, **fields), why)
            self.book.check_idle()
            fields["engine_addresses"] = fresh
            message = "Scale-out request accepted" + (f"; skipped known addresses {skipped}" if skipped else "")
        op = self.book.new(OperationType.SCALE_OUT, reason="scale-out request accepted", store=store, **fields)
        if dry_run:
            return op, "dry run: nothing changed; " + message
        await self.save()
        self._spawn(op, lambda s, o: scale_runs.run_out(s, o, placements), scale_runs.rollback_out)
        return op, message

    def _placements(self, model: str, need: int) -> list[str]:
        """Node ids for ``need`` new replicas, most free slots first; FAILED_PRECONDITION when they do not fit."""
        per = self.config.rollout_num_gpus_per_engine
        free: dict[str, int] = {}
        registry = self.registry
        for node in registry.nodes():
            if node.lease_held and not node.external and node.model_name == model:
                used = sum(len(r.slots) or per for r in registry.replicas(node_id=node.node_id)
                           if r.state not in TERMINAL_STATES)
                free[node.node_id] = node.slots_total - used
        out: list[str] = []
        for _ in range(need):
            node_id = max(sorted(free), key=lambda n: free[n], default=None)
            if node_id is None or free[node_id] < per:
                raise FailedPrecondition(
                    f"native scale-out needs {need} replica(s) of {per} slot(s) for model {model!r}, but only "
                    f"{len(out)} fit; free slots: {_free_summary(free)}", reason=Reason.NO_FREE_SLOTS,
                    metadata={"nodes": str(len(free)), "free_slots": str(sum(max(0, f) for f in free.values()))})
            free[node_id] -= per
            out.append(node_id)
        return out

    # --------------------------------------------------------------- scale-in
    async def scale_in(self, *, model_name: str = "", num_replicas: int = 0, replica_ids: Sequence[str] = (),
                       engine_addresses: Sequence[str] = (), force: bool = False, timeout_s: float | None = None,
                       dry_run: bool = False, request_id: str = "",
                       triggered_by: str = "user") -> tuple[ScaleOperation, list[str], str]:
        model = model_name or "default"
        ids, addresses = list(replica_ids), list(engine_addresses)
        if num_replicas < 0:
            raise InvalidArgument(f"num_replicas must be >= 0, got {num_replicas}", reason=Reason.INVALID_TARGET)
        if not num_replicas and not ids and not addresses:
            raise InvalidArgument("give num_replicas > 0 (target remaining count), or replica_ids and/or "
                                  "engine_addresses", reason=Reason.NOTHING_TO_SCALE_IN)
        if any(not r for r in ids) or len(set(ids)) != len(ids):
            raise InvalidArgument(f"replica_ids must be non-empty and distinct: {ids}", reason=Reason.INVALID_REPLICA_ID)
        addresses = check_addresses(addresses, "engine_addresses")
        default_timeout = self.config.scale_in_drain_timeout + self.config.scale_in_shutdown_timeout + 30.0
        timeout = self._timeout(timeout_s, default_timeout)
        fingerprint = json.dumps(["in", model, num_replicas, ids, addresses, force, timeout_s])
        retried = self.book.by_request_id(request_id, fingerprint)
        if retried is not None and not dry_run:
            return retried, list(retried.replica_ids), f"retry of request_id {request_id!r}"
        pool = self.pool(model)
        protected = [r for r in pool if r.initial]
        fields: dict[str, Any] = dict(model_name=model, num_replicas=num_replicas, engine_addresses=addresses,
                                      force=force, timeout_s=timeout, triggered_by=triggered_by,
                                      request_id=request_id, fingerprint=fingerprint, dry_run=dry_run,
                                      engines_before=len(pool))
        store = not dry_run
        if num_replicas:
            if num_replicas < len(protected):
                raise FailedPrecondition(
                    f"num_replicas {num_replicas} is below the {len(protected)} initial replica(s) of {model!r}, "
                    "which are protected from scale-in", reason=Reason.PROTECTED_REPLICA,
                    metadata={"protected": str(len(protected))})
            if num_replicas >= len(pool):
                why = f"{len(pool)} replicas of {model!r} already at or below the target {num_replicas}"
                return self.book.new(OperationType.SCALE_IN, state=OS.NOOP, reason=why, store=store, **fields), [], why
            candidates = sorted((r for r in pool if not r.initial), key=lambda r: (r.added_at, r.replica_id),
                                reverse=True)
            chosen = [r.replica_id for r in candidates[:len(pool) - num_replicas]]
        else:
            chosen = self._named(model, ids, addresses)
            if not chosen:
                why = "every named replica is already stopped or removed"
                return self.book.new(OperationType.SCALE_IN, state=OS.NOOP, reason=why, store=store, **fields), [], why
        self.book.check_idle()
        op = self.book.new(OperationType.SCALE_IN, reason=f"selected {chosen} (last in, first out)"
                           if num_replicas else f"selected {chosen}", store=store, replica_ids=chosen, **fields)
        if dry_run:
            return op, chosen, f"dry run: would remove {chosen}; nothing changed"
        await self.save()
        self._spawn(op, scale_runs.run_in, scale_runs.restore_in)
        return op, chosen, "Scale-in request accepted"

    def _named(self, model: str, ids: list[str], addresses: list[str]) -> list[str]:
        registry = self.registry
        records = [registry.get(r) for r in ids]
        for address in addresses:
            at = [r for r in registry.replicas() if address in (r.address, r.engine_url)]
            if not at:
                raise NotFound(f"no replica is registered at {address}", reason=Reason.ADDRESS_NOT_FOUND,
                               metadata={"address": address})
            records += [r for r in at if r.kind is ReplicaKind.STANDALONE and r not in records]
        for record in records:
            if record.kind is not ReplicaKind.STANDALONE:
                raise FailedPrecondition(f"replica {record.replica_id} is HYBRID; hybrid replicas belong to the "
                                         "dynamic-resource scheduler and are not scaled", reason=Reason.HYBRID_REPLICA)
            if record.initial:
                raise FailedPrecondition(f"replica {record.replica_id} is an initial replica, protected from "
                                         "scale-in", reason=Reason.PROTECTED_REPLICA,
                                         metadata={"replica_id": record.replica_id})
            if record.model_name != model:
                raise InvalidArgument(f"replica {record.replica_id} serves model {record.model_name!r}, not "
                                      f"{model!r}", reason=Reason.WRONG_MODEL)
        return [r.replica_id for r in records if r.state not in TERMINAL_STATES]

    # ------------------------------------------------------------------ cancel
    async def cancel(self, operation_id: str) -> ScaleOperation:
        op = self.book.get(operation_id)
        if op.state is OS.CANCELLED:
            return op
        if not cancellable(op):
            what = "it has finished" if op.finished else "a scale-in can only be cancelled while PENDING"
            raise FailedPrecondition(f"scale operation {operation_id} is {op.state.value} and cannot be cancelled "
                                     f"({what})", reason=Reason.OPERATION_NOT_CANCELLABLE,
                                     metadata={"operation_id": operation_id, "state": op.state.value})
        task = self.tasks.get(operation_id)
        if task is None:
            await self.move(op, OS.CANCELLED, "cancelled by user")
            return op
        task.cancel()
        await asyncio.wait({task}, timeout=self.config.async_training.port_timeout_s * 4 + 10)
        return op

    async def delete(self, operation_id: str) -> None:
        """Forget a finished operation, durably."""
        self.book.delete(operation_id)
        await self.save()

    async def cancel_many(self, states: set[OperationState], dry_run: bool) -> list[str]:
        if states and states <= TERMINAL:
            raise InvalidArgument(f"states lists only finished states ({sorted(s.value for s in states)}); none "
                                  "of those can be cancelled", reason=Reason.TERMINAL_STATES_ONLY)
        targets = [op for op in self.book.list() if cancellable(op) and (not states or op.state in states)]
        if not dry_run:
            for op in targets:
                await self.cancel(op.operation_id)
        return [op.operation_id for op in targets]

    # ------------------------------------------------------- restart, shutdown
    def recover(self) -> None:
        """Resume or end the operations a previous controller process left running."""
        for op in self.book.list():
            if op.finished:
                continue
            if op.type is OperationType.SCALE_OUT and op.state is OS.READY:
                self._spawn(op, scale_runs.resume_ready, scale_runs.rollback_out)
            elif op.type is OperationType.SCALE_OUT:
                self._spawn(op, scale_runs.restart_failed, scale_runs.rollback_out)
            elif op.state is OS.PENDING:   # at start, before serving: written at once
                self.book.transition(op, OS.FAILED, "controller restarted before the scale-in started; "
                                                    "nothing was changed")
                self.store.mark("operations", "registry/node", "events")
                self.store.flush()
                self._finished(op)
            else:
                self._spawn(op, scale_runs.resume_in, scale_runs.restore_in)

    async def hold_external_leases(self) -> None:
        """Nodes connected by an external scale-out push no reports: poll them and renew their lease.

        The nodes are polled concurrently, so one slow agent does not starve
        the others' leases. A node may be forgotten (rolled back, scaled in)
        while its poll is in flight; that poll's answer is then dropped. The
        loop itself never ends on one node's error.
        """
        while True:
            await asyncio.sleep(self.config.load_report_interval_s)
            nodes = [n for n in self.registry.nodes() if n.external and n.lease_held]
            if nodes:
                await asyncio.gather(*(self._poll_external(n.node_id, n.address) for n in nodes))

    async def _poll_external(self, node_id: str, address: str) -> None:
        try:
            reports = await self.calls.load_reports(address)
        except Exception as err:  # noqa: BLE001 - the lease then runs out on its own
            log.debug("external node %s did not report: %s", node_id, err)
            return
        node = next((n for n in self.registry.nodes() if n.node_id == node_id), None)
        if node is None or not node.lease_held or node.address != address:
            return  # forgotten, expired or replaced while the poll was in flight
        try:
            self.renew(node_id, reports)
        except Exception as err:  # noqa: BLE001 - a bad report must not end the loop for every node
            log.warning("external node %s: its load reports could not renew the lease: %s", node_id, err)

    async def close(self) -> None:
        self._closing = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)


def _free_summary(free: dict[str, int], shown: int = 5) -> str:
    """Free slots in a bounded form whatever the fleet's size: the total, then the nodes with the most."""
    if not free:
        return "no node registered"
    most = sorted(free.items(), key=lambda item: (-item[1], item[0]))[:shown]
    listed = ", ".join(f"{node} {slots}" for node, slots in most)
    more = f", and {len(free) - shown} more node(s)" if len(free) > shown else ""
    return f"{sum(max(0, f) for f in free.values())} on {len(free)} node(s); most: {listed}{more}"
