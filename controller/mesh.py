"""The controller's domain, assembled: core objects, real ports, persistence, events, leases.

:class:`Mesh` is what the servicer delegates to. It builds the I/O-free core
(registry, event log, dynamic resource controller, cycle metrics) on the wall
clock, wires it to the other servers through the gRPC ports, persists it in
the state directory, fans events out to watchers, expires leases, and keeps
the load balancer's routing table in line with the registry. Scale
operations (:class:`~controller.scaling.Scaler`) and the autoscaler loop
(:class:`~controller.scaling.autoscaler_loop.AutoscalerLoop`) hang off it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import tracing
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import load_pb2, types_pb2
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from rollmesh.controller.v1 import registry_pb2
from rollmesh.loadbalancer.v1 import routing_pb2

from .config import ControllerConfig
from .core.admission import Admission
from .core.events import EventLog, EventType, LifecycleEvent, log_event
from .core.hybrid import DynamicResourceController
from .core.metrics import CycleMetrics
from .core.records import TERMINAL_STATES, Registration, ReplicaRecord, ReplicaState
from .core.replicas import ReplicaRegistry
from .core.steps import BeginDecision, CompleteResult, ReleaseResult, StepReport
from .agents import AgentCalls
from .balancers import Balancers
from .checkpoint_load import CheckpointFlip
from .group_update import GroupUpdate
from .ports import AgentReplicas, Channels, LoadBalancerRouting
from .routing import Routing
from .weight_requests import WeightRequests
from .weight_sync import WeightBroadcast
from .store import StateStore
from .store_backends import StoreBackend, parse_store
from .store_owner import StoreOwnership
from .watchers import EventHub

log = logging.getLogger(__name__)
S = ReplicaState
_NOT_HOSTED = frozenset({types_pb2.REPLICA_STATE_STOPPED, types_pb2.REPLICA_STATE_FAILED,
                         types_pb2.REPLICA_STATE_REMOVED})
"""Load-report states of a replica its agent no longer runs."""
def _trace_ids() -> tuple[str, str]:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class Mesh:
    """The controller's composition root: builds the registry, scheduling, weight sync, scaling, routing and
    events, wires each its ports, and serves the RPCs as :class:`~controller.api.ControllerApi`."""

    def __init__(self, config: ControllerConfig, tracer_provider: TracerProvider | None, *,
                 backend: StoreBackend | None = None, ownership: StoreOwnership | None = None,
                 read_only: bool = False) -> None:
        """``backend`` defaults to the one ``config.store`` names. On an etcd store, ``ownership`` (already
        acquired, :mod:`controller.leadership`) makes this the leader's mesh; ``read_only`` a standby's copy
        that loads the state and never writes it."""
        self.config = config
        self.clock = time.time
        self.tracer = tracing.tracer(tracer_provider, "rollmesh.controller")
        if backend is None:
            backend = parse_store(config.store, config.state_dir, config.store_tls)
        self.ownership = ownership
        self.read_only = read_only
        self.store = StateStore(backend, keep_events=config.event_retention_max)
        self.store.read_only = read_only
        self.events = EventLog(self.clock, max_events=config.event_retention, max_age_s=config.event_retention_s,
                               hard_max=config.event_retention_max, trace_ids=_trace_ids)
        self.event_listeners: list[Callable[[LifecycleEvent], None]] = []
        """Called with every event as it is recorded (the Prometheus counters)."""
        self.hub = EventHub(self.events, config.watcher_queue_size)
        self.store.on_events_stored = self.hub.stored   # a stream shows an event once no crash can undo it
        self.admission = Admission(config.max_registrations_per_s, time.monotonic)
        self._migrated_registry = False
        self.registry = self._restore_registry()
        self._ejections_seen: dict[str, int] = {}
        """Ejections per replica the balancer reported in the last reconcile round."""
        self._missing_reports: dict[str, int] = {}
        """Load reports in a row that lacked a live replica of their node."""
        self._leftover_stops: dict[str, float] = {}
        self._background: set[asyncio.Future] = set()
        self._acting: list[asyncio.Task] = []
        self.channels = Channels(tracer_provider, tls=config.tls)
        sched = config.async_training
        self.balancers = Balancers(config.load_balancer_address, lease_ttl_s=config.lease_ttl_s, store=self.store,
                                   clock=self.clock, emit=self.emit, span=self.span, commit=self.commit)
        self.routing = Routing(self.registry, LoadBalancerRouting(
            self.channels, config.load_balancer_address, sched.port_timeout_s, registered=self.balancers.registered))
        """Who is routed: the rule and the one writer of the balancers' tables (:mod:`controller.routing`)."""
        self.replica_port = AgentReplicas(self.channels, self.registry, sched.port_timeout_s)
        self.weights = WeightBroadcast(self.channels, self.registry, self.routing,
                                       trainer_address=config.trainer_address, timeout_s=sched.weight_sync_timeout_s,
                                       backend=config.weight_sync_backend,
                                       bucket_size_bytes=config.weight_bucket_size_bytes,
                                       peer_copy_sources=config.peer_copy_sources)
        self.metrics = CycleMetrics(hybrid_gpus=config.hybrid_gpus, standalone_gpus=config.standalone_gpus,
                                    concurrent_samples_per_replica=config.concurrent_samples_per_replica,
                                    max_required_samples=config.max_required_samples)
        self.transitions = asyncio.Lock()
        """The one lock of every change of routing or weights: the scheduler takes it around each step-protocol
        call, scale operations around their routing and weight changes, SyncWeights around its broadcast,
        routing reconciliation around its round (it waits its turn: the lock is fair, so a fast training loop
        cannot starve it). Hybrid steps and scale operations never interleave on the same replicas."""
        self.scheduler = DynamicResourceController(
            sched, registry=self.registry, routing=self.routing, replicas=self.replica_port, weights=self.weights,
            clock=self.clock, emit=self.emit, tracer=self.span, metrics=self.metrics, lock=self.transitions)
        for key, source in {"events": self.events.to_document, "scheduler": self.scheduler.to_document,
                            "metrics": self.metrics.to_document}.items():
            self.store.track(key, source)
        self.store.track_collection("registry/node", self.registry.take_changes)   # one document per node
        if self._migrated_registry and not read_only:   # the old single document goes once every node's is on disk
            self.store.flush()
            self.store.delete("registry")
        self._restore_rest()
        self.weight_requests = WeightRequests(
            registry=self.registry, routing=self.routing, scheduler=self.scheduler, weights=self.weights,
            checkpoints=CheckpointFlip(self.channels, self.registry, self.weights.push_versions),
            groups=GroupUpdate(self.channels, self.registry, self.weights.push_versions),
            transitions=self.transitions, emit=self.emit, span=self.span, commit=self.commit)
        """The operator's weight requests: SyncWeights, LoadWeights, UpdateWeightsFromGroup."""
        from .scaling.autoscaler_loop import AutoscalerLoop  # noqa: PLC0415
        from .scaling.scaler import Scaler  # noqa: PLC0415

        calls = AgentCalls(self.channels, timeout_s=sched.port_timeout_s,
                           balancers=lambda: [b.address for b in self.routing.balancers])
        self.scaler = Scaler(config, store=self.store, registry=self.registry, routing=self.routing,
                             weights=self.weights, scheduler=self.scheduler, transitions=self.transitions,
                             calls=calls, clock=self.clock, emit=self.emit, span=self.span, renew=self.renew)
        self.routing.bind(weight_version=lambda: self.scheduler.weight_version,
                          hybrid_active=lambda: self.scheduler.is_hybrid_active, owned=self.scaler.blocks_routing)
        self.autoscaler = AutoscalerLoop(config.load_autoscaler(), controller_config=config, store=self.store,
                                         registry=self.registry, scaler=self.scaler, clock=self.clock,
                                         emit=self.emit, span=self.span, changed=self.changed)

    # ----------------------------------------------------------- persistence
    def _restore_registry(self) -> ReplicaRegistry:
        saved_events = self.store.load("events", state_pb2.EventsDocument)
        if saved_events is not None:
            self.events.restore(saved_events, self.store.load_events(self.config.event_retention_max))
            self.hub.stored_sequence = self.events.last_sequence   # loaded from the store: stored
            self.store.prune_events(self.config.event_retention_max)
        documents = self.store.load_collection("registry/node", state_pb2.NodeDocument)
        if documents:
            return ReplicaRegistry.from_documents(documents, clock=self.clock, emit=self.emit,
                                                  lease_ttl_s=self.config.lease_ttl_s)
        saved = self.store.load("registry", state_pb2.RegistryDocument)   # the format before one document per
        if saved is not None:                                              # node: migrated on next write
            self._migrated_registry = True
            return ReplicaRegistry.restore(saved.nodes, saved.replicas, clock=self.clock, emit=self.emit,
                                           lease_ttl_s=self.config.lease_ttl_s)
        return ReplicaRegistry(clock=self.clock, emit=self.emit, lease_ttl_s=self.config.lease_ttl_s)

    def _restore_rest(self) -> None:
        saved = self.store.load("scheduler", state_pb2.SchedulerDocument)
        if saved is not None:
            self.scheduler.restore(saved)
        saved_metrics = self.store.load("metrics", state_pb2.MetricsDocument)
        if saved_metrics is not None:
            self.metrics.restore(saved_metrics)
        if self.read_only:
            return
        if saved is not None or saved_metrics is not None:
            self.emit(EventType.CONTROLLER_STATE_CHANGED, reason="controller restarted; state restored",
                      to_state=self.scheduler.hybrid_state.proto_name)
        if self.ownership is not None:
            ownership = self.ownership
            self.emit(EventType.LEADER_CHANGED, from_state=ownership.previous, to_state=ownership.owner,
                      reason=f"took over the state store {self.store.description}" + (
                          f" from {ownership.previous} after {ownership.waited_s:.1f} s" if ownership.previous
                          else ""),
                      attributes={"waited_s": round(ownership.waited_s, 3),
                                  "fence_revision": ownership.fence_revision})

    def changed(self) -> None:
        """Something durable changed in the background: persist it shortly."""
        self.store.mark()

    async def commit(self) -> None:
        """Something an RPC is about to acknowledge changed: persist it now, before the reply."""
        await self.store.commit()

    # ---------------------------------------------------------------- events
    def emit(self, type: EventType, /, **fields: Any) -> LifecycleEvent:
        event = self.events.append(type, **fields)
        log_event(event, log)
        for listener in self.event_listeners:
            listener(event)
        self.store.append_event(event.sequence, event.to_document())
        self.store.mark("events", "registry/node")
        return event

    def observe(self, on_event: Callable[[LifecycleEvent], None], on_write: Callable[[float, bool], None]) -> None:
        """Call ``on_event`` with every event recorded from now on (once, however often it is asked), and
        ``on_write`` after every batch the store writes (the controller's metrics)."""
        if on_event not in self.event_listeners:
            self.event_listeners.append(on_event)
        self.store.on_write = on_write

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[trace.Span]:
        attrs = {f"rollmesh.{k}": (list(v) if isinstance(v, (list, tuple)) else v)
                 for k, v in attributes.items() if v is not None}
        with self.tracer.start_as_current_span(name, attributes=attrs) as span:
            yield span

    # ------------------------------------------------ step protocol, weights
    async def begin_step(self, global_step: int, report: StepReport) -> BeginDecision:
        decision = await self.scheduler.begin_step(global_step, report)
        await self.commit()   # durable before acknowledged
        return decision

    async def release_hybrid(self, global_step: int, buffered_samples: int, waited_s: float,
                             wait_expired: bool) -> ReleaseResult:
        result = await self.scheduler.release_hybrid(global_step, buffered_samples, waited_s, wait_expired)
        await self.commit()
        return result

    async def complete_step(self, global_step: int, weight_version: int, report: StepReport) -> CompleteResult:
        result = await self.scheduler.complete_step(global_step, weight_version, report)
        await self.commit()
        return result

    # ----------------------------------------------------------- registration
    @property
    def state_store(self) -> str:
        return self.store.description

    @property
    def last_event_sequence(self) -> int:
        return self.events.last_sequence

    def balancer_addresses(self) -> list[str]:
        return [balancer.address for balancer in self.routing.balancers]

    def admit(self) -> float:
        return self.admission.admit()

    async def deregister_node(self, node_id: str, reason: str) -> list[str]:
        stopped = self.registry.deregister_node(node_id, reason)
        await self.routing.converge(stopped)
        await self.commit()
        return stopped

    async def register_node(self, request: registry_pb2.RegisterNodeRequest) -> Registration:
        from mesh_runtime.validate import check_address, check_id, check_number, quote  # noqa: PLC0415

        from . import convert  # noqa: PLC0415

        check_id(request.node_id, "node_id")
        check_address(request.address, "address")
        if request.slots_total == 0:
            raise _invalid("slots_total must be > 0")
        seen: set[str] = set()
        for index, replica in enumerate(request.replicas):   # everything is checked before anything changes
            where = f"replicas[{index}]"
            check_id(replica.replica_id, f"{where}.replica_id")
            if replica.replica_id in seen:
                raise _invalid(f"{where}.replica_id {quote(replica.replica_id)} appears twice")
            seen.add(replica.replica_id)
            check_number(replica.memory_fraction, f"{where}.memory_fraction", low=0.0, high=1.0)
            for slot in replica.slots:
                if slot >= request.slots_total:
                    raise _invalid(f"{where}.slots: slot {slot} does not exist on a node with slots_total "
                                   f"{request.slots_total} (slots are 0..{request.slots_total - 1})")
        specs = convert.replica_specs(request)
        with self.span("registry.register_node", node_id=request.node_id, replicas=len(specs)):
            registration = self.registry.register_node(
                request.node_id, request.address, replicas=specs, slots_total=request.slots_total,
                backend=convert.types_pb2.EngineBackend.Name(request.backend), model=request.model,
                model_name=request.model_name or "default", agent_version=request.agent_version)
            await self.routing.converge(registration.accepted)
        await self.commit()
        return registration

    async def reconcile_routing(self) -> tuple[list[str], list[str]]:
        """One level-triggered round (:meth:`controller.routing.Routing.reconcile`), under ``transitions``:
        after whatever step call, sync or scale operation holds it (each owns routing while it runs)."""
        async with self.transitions:
            return await self.routing.reconcile(observe=self._report_ejections,
                                                after_round=self.balancers.after_round)

    def _report_ejections(self, routed: dict[str, routing_pb2.RoutedReplica]) -> None:
        """An event for each replica the balancer ejected since the last round (outlier detection)."""
        seen = self._ejections_seen
        for replica_id, route in routed.items():
            if route.ejections > seen.get(replica_id, 0):
                self.emit(EventType.REPLICA_EJECTED, replica_id=replica_id,
                          node_id=route.endpoint.node_id, reason=f"balancer: {route.unroutable_reason}",
                          attributes={"ejections": str(route.ejections),
                                      "consecutive_failures": str(route.consecutive_failures)})
        self._ejections_seen = {r: route.ejections for r, route in routed.items() if route.ejections}

    async def run_reconcile(self) -> None:
        """Reconcile the balancers' routing every ``reconcile_interval_s`` (and at once when a balancer
        registers) until cancelled."""
        while True:
            await self.balancers.until_next_round(self.config.reconcile_interval_s)
            try:
                await self.reconcile_routing()
            except grpc.aio.AioRpcError as err:   # the balancer is down or restarting: the next round heals it
                log.info("routing reconcile: balancer unavailable (%s)", err.code().name)
            except Exception:  # noqa: BLE001 - one failed round must not end the loop
                log.exception("routing reconcile round failed")

    def pace(self) -> tuple[float, float]:
        """(report interval, lease TTL) the agents are told now: the configured ones, or, once the fleet's
        reports would exceed ``max_load_reports_per_s``, an interval of nodes / that budget and a TTL grown
        by the same factor (a lease still spans as many missed reports)."""
        config = self.config
        nodes = self.registry.node_count()
        interval = max(config.load_report_interval_s, nodes / config.max_load_reports_per_s)
        if interval > config.load_report_interval_s:   # in steps of a quarter, so a growing fleet changes it rarely
            interval = math.ceil(interval / (config.load_report_interval_s / 4)) * (config.load_report_interval_s / 4)
        ttl = config.lease_ttl_s * interval / config.load_report_interval_s
        if ttl != self.registry.lease_ttl_s:
            self.registry.leases.ttl_s = ttl
        return interval, ttl

    def renew(self, node_id: str, reports: Sequence[load_pb2.LoadReport]) -> tuple[float, bool]:
        """Renew the node's lease with one load report and reconcile its replicas with what the agent hosts.

        A load-report message lists every replica the agent hosts. A replica
        the registry holds live on this node but that is missing from two
        reports in a row is FAILED (the agent lost it: an engine crash, an agent
        restarted without it) and so leaves routing at the next reconcile round.
        A reported replica the registry does not hold, or holds FAILED, makes
        the answer ``True``: the agent must register again, which adopts it
        (the controller lost its state, or failed it during a freeze); one the
        controller stopped or removed is stopped on the agent again. Returns
        ``(lease expiry, register again)``.
        """
        expires = self.registry.renew(node_id)
        reported: set[str] = set()
        register_again = False
        for report in reports:
            serving = report.state not in _NOT_HOSTED   # a stopped replica stays in its agent's reports a while
            if serving:
                reported.add(report.replica_id)
            record = self.registry.get(report.replica_id) if report.replica_id in self.registry else None
            if record is None or record.node_id != node_id or record.state is S.FAILED:
                register_again = register_again or serving
                continue
            if record.state in (S.STOPPED, S.REMOVED):
                if serving:
                    self._stop_leftover(record)
                continue
            self.registry.record_report(report.replica_id, report)
        for record in self.registry.replicas(node_id=node_id):
            if record.state in TERMINAL_STATES or record.state in (S.LAUNCHING, S.LOADING) \
                    or record.replica_id in reported:   # the controller is bringing it up: not yet the agent's
                self._missing_reports.pop(record.replica_id, None)
                continue
            misses = self._missing_reports[record.replica_id] = self._missing_reports.get(record.replica_id, 0) + 1
            if misses >= 2:
                del self._missing_reports[record.replica_id]
                self.registry.transition(record.replica_id, S.FAILED,
                                         f"node {node_id}'s agent no longer hosts it (missing from its load reports)")
                self.store.mark("registry/node")
        return expires, register_again

    def _stop_leftover(self, record: ReplicaRecord) -> None:
        """A replica the controller stopped or removed still runs on its agent: stop it again (once a minute)."""
        now = time.monotonic()
        if now - self._leftover_stops.get(record.replica_id, -1e9) < 60.0:
            return
        self._leftover_stops[record.replica_id] = now
        log.warning("replica %s is %s but its agent still hosts it: stopping it there", record.replica_id,
                    record.state.value)
        task = asyncio.ensure_future(self.replica_port.stop([record.replica_id]))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def expire_leases(self) -> None:
        failed = self.registry.expire_leases()
        if failed:
            ids = [r.replica_id for r in failed]
            log.warning("lease expired: replicas %s FAILED, removed from routing; their requests resume elsewhere",
                        ids)
            with contextlib.suppress(Exception):   # the agent may be frozen: the balancer cuts its attempts there
                await self.routing.converge(ids, abort_in_flight=True)
            self.changed()

    async def run_leases(self) -> None:
        interval = min(1.0, self.config.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_leases()
            except Exception:  # noqa: BLE001 - leases must keep being checked after one bad round
                log.exception("checking leases failed; trying again in %.2f s", interval)

    def start_acting(self, spawn: Callable[..., asyncio.Task]) -> None:
        """Start everything that acts on the mesh (the leader's work): the store writer, lease expiry, routing
        reconciliation, external engines' leases, the autoscaler; recover interrupted scale operations."""
        if self.read_only:
            raise RuntimeError("a read-only copy of the mesh does not act")
        tasks = [spawn(self.store.run(), name="state-store"), spawn(self.run_leases(), name="leases"),
                 spawn(self.run_reconcile(), name="routing-reconcile"),
                 spawn(self.balancers.run_leases(), name="balancer-leases"),
                 spawn(self.scaler.hold_external_leases(), name="external-leases")]
        self.scaler.recover()
        if self.autoscaler.configured:
            tasks.append(spawn(self.autoscaler.run(), name="autoscaler"))
        self._acting = tasks

    async def stop_acting(self, streams_end: Exception) -> None:
        """Stop everything :meth:`start_acting` started (a deposed leader; this becomes a read-only copy):
        nothing more is written, every event stream ends with ``streams_end``, scale operations stop driving,
        and the store's ownership is forgotten (its lease is gone or going: nobody releases it)."""
        self.store.read_only = True
        self.hub.close(streams_end)
        acting, self._acting = self._acting, []
        for task in acting:
            task.cancel()
        await asyncio.gather(*acting, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.scaler.close()
        self.ownership = None

    async def close(self) -> None:
        await self.scaler.close()
        try:
            self.store.close()
        finally:
            if self.ownership is not None:
                self.ownership.release()   # a waiting controller takes over now, not after the lease
        await self.channels.close()




def _invalid(message: str) -> Exception:
    from mesh_runtime.errors import InvalidArgument  # noqa: PLC0415

    return InvalidArgument(message, reason=Reason.INVALID_REGISTRATION)


