"""The autoscaler loop inside the controller (on only with ``autoscaler_config``).

Every ``metrics_interval_secs`` it aggregates the latest load reports of the
model's ACTIVE replicas (reports whose node renewed its lease recently) into
a :class:`~controller.scaling.autoscaler.MetricsSample`: mean KV-cache usage
(token_usage), summed waiting requests (num_queue_reqs), the highest queue
time and TTFT p95, summed generation throughput. Every
``evaluation_interval_secs`` the pure core decides; each decision is an
AUTOSCALER_DECISION event and an ``autoscaler.decide`` span. A scale-out or
scale-in decision starts a native scale operation with
``triggered_by="autoscaler"`` and a history record (the reference's fields)
that is completed when the operation finishes. The cooldown runs from the
start and again from the end of each operation. State (enabled, history,
last scale) is persisted with the rest of the controller's state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mesh_runtime.durations import to_seconds
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .autoscaler import (
    NONE, SCALE_IN, SCALE_OUT, Autoscaler, AutoscalerConfig, Decision, MetricsSample, throughput_cv2)
from ..core.events import EventType
from .operations import OperationType, ScaleOperation
from ..core.records import ReplicaState

log = logging.getLogger(__name__)
MODEL = "default"
HISTORY_LIMIT = 1000

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ..config import ControllerConfig
    from ..core.replicas import ReplicaRegistry
    from ..store import StateStore
    from .scaler import Scaler


class AutoscalerLoop:
    """Collects metrics, runs the decision core, starts scale operations, keeps the history."""

    def __init__(self, config: AutoscalerConfig | None, *, controller_config: ControllerConfig, store: StateStore,
                 registry: ReplicaRegistry, scaler: Scaler, clock: Callable[[], float], emit: Callable[..., Any],
                 span: Callable[..., AbstractContextManager[Any]], changed: Callable[[], None]) -> None:
        """The controller's parts the autoscaler uses, as explicit ports (the :class:`~controller.mesh.Mesh`
        wires them): ``scaler`` runs the operations it decides, ``changed`` persists the controller's state
        soon."""
        self.controller_config = controller_config
        self.store, self.registry, self.scaler = store, registry, scaler
        self.clock, self.emit, self.span, self.changed = clock, emit, span, changed
        self.core = Autoscaler(config) if config is not None else None
        self.running = False
        self.history: list[state_pb2.AutoscalerAction] = []
        self.pending: set[str] = set()
        self.decided_at: float | None = None
        store.track("autoscaler", self.to_document)
        saved = store.load("autoscaler", state_pb2.AutoscalerDocument)
        if saved is not None and self.core is not None:
            self.core.enabled = saved.enabled
            self.core.last_scale_action = saved.last_scale_action if saved.HasField("last_scale_action") else None
            self.core.last_scale_time = saved.last_scale_time if saved.HasField("last_scale_time") else None
            self.history = list(saved.history)
            self.pending = {h.operation_id for h in self.history if not h.completed_at}
        scaler.on_finished.append(self._finished)

    @property
    def configured(self) -> bool:
        return self.core is not None

    @property
    def _active(self) -> Autoscaler:
        """The decision core, for the paths that run only when an autoscaler is configured."""
        if self.core is None:
            raise RuntimeError("no autoscaler is configured")
        return self.core

    def to_document(self) -> state_pb2.AutoscalerDocument:
        core = self.core
        return state_pb2.AutoscalerDocument(enabled=core.enabled if core else False,
                                            history=self.history[-HISTORY_LIMIT:],
                                            last_scale_action=core.last_scale_action if core else None,
                                            last_scale_time=core.last_scale_time if core else None)

    # ----------------------------------------------------------------- inputs
    def engines(self) -> int:
        """Replicas of the model serving now (what the metrics describe)."""
        return len([r for r in self.registry.replicas(states=[ReplicaState.ACTIVE]) if r.model_name == MODEL])

    def collect(self, now: float) -> MetricsSample:
        registry, cfg = self.registry, self.controller_config
        fresh_for = 3 * cfg.load_report_interval_s + self._active.config.metrics_interval_secs
        nodes = {n.node_id: n for n in registry.nodes()}
        reports = []
        for record in registry.replicas(states=[ReplicaState.ACTIVE]):
            node = nodes.get(record.node_id)
            if (record.model_name == MODEL and record.last_report is not None and node is not None
                    and node.lease_held and node.last_report_at and now - node.last_report_at <= fresh_for):
                reports.append(record.last_report)
        n = len(reports)
        return MetricsSample(
            time=now, num_engines=n,
            avg_token_usage=sum(r.kv_cache_usage for r in reports) / n if n else 0.0,
            total_queue_reqs=sum(r.waiting_requests for r in reports),
            queue_time_p95=max((to_seconds(r.queue_time_p95) for r in reports), default=0.0),
            ttft_p95=max((to_seconds(r.time_to_first_token_p95) for r in reports), default=0.0),
            throughput=sum(r.generation_tokens_per_second for r in reports))

    def throughput_variance(self) -> float:
        window = self._active.config.condition_durations.throughput_stable_secs
        latest = self._active.latest
        if latest is None:
            return 0.0
        values = [s.throughput for s in self._active.samples() if s.time >= latest.time - window]
        value = throughput_cv2(values)
        return value if value != float("inf") else -1.0

    # ------------------------------------------------------------------- loop
    async def run(self) -> None:
        cfg = self._active.config
        self.running = True
        loop = asyncio.get_running_loop()
        next_evaluation = loop.time() + cfg.evaluation_interval_secs
        try:
            while True:
                await asyncio.sleep(min(cfg.metrics_interval_secs, cfg.evaluation_interval_secs))
                now = self.clock()
                try:
                    self._active.record_metrics(self.collect(now))
                except Exception:  # noqa: BLE001 - one bad sample must not stop the loop
                    log.exception("autoscaler: collecting engine metrics failed")
                    continue
                if loop.time() >= next_evaluation:
                    next_evaluation = loop.time() + cfg.evaluation_interval_secs
                    try:
                        await self.evaluate(now)
                    except Exception:  # noqa: BLE001 - one bad evaluation must not stop the loop
                        log.exception("autoscaler evaluation failed")
        finally:
            self.running = False

    async def evaluate(self, now: float) -> None:
        scaler = self.scaler
        running = scaler.book.running() is not None or bool(self.pending)
        engines = self.engines()
        with self.span("autoscaler.decide", engines=engines) as span:
            decision = self._active.evaluate(now, running, current_engines=engines)
            self.decided_at = now
            if span is not None:
                span.set_attribute("rollmesh.action", decision.action)
                span.set_attribute("rollmesh.delta", decision.delta)
                span.set_attribute("rollmesh.reason", decision.reason)
            op, error = None, ""
            if decision.action != NONE:
                pool = len(scaler.pool(MODEL))
                target = pool + decision.delta if decision.action == SCALE_OUT else pool - decision.delta
                try:
                    if decision.action == SCALE_OUT:
                        op, _ = await scaler.scale_out(model_name=MODEL, num_replicas=target,
                                                       triggered_by="autoscaler")
                    else:
                        op, _, _ = await scaler.scale_in(model_name=MODEL, num_replicas=max(target, 0),
                                                         triggered_by="autoscaler")
                except Exception as err:  # noqa: BLE001 - reported in the decision event
                    error = f"{type(err).__name__}: {getattr(err, 'message', err)}"
            self.emit(EventType.AUTOSCALER_DECISION, reason=decision.reason + (f"; not started: {error}"
                                                                                    if error else ""),
                           operation_id=op.operation_id if op else "",
                           attributes={"action": decision.action, "delta": decision.delta, "engines": engines,
                                       "triggered_conditions": list(decision.triggered_conditions),
                                       **{k: v for k, v in decision.metrics_snapshot.items() if k != "time"}})
        if op is not None and op.state.value != "NOOP":
            self._active.record_scale(decision.action, now)
            self.pending.add(op.operation_id)
            self.history.append(history_entry(op, decision, now))
        self.changed()

    def _finished(self, op: ScaleOperation) -> None:
        if op.operation_id not in self.pending:
            return
        self.pending.discard(op.operation_id)
        for record in self.history:
            if record.operation_id == op.operation_id:
                record.state, record.completed_at, record.error_message = (op.state.value, op.updated_at,
                                                                          op.error_message)
        if self.core is not None:
            self.core.record_scale(SCALE_OUT if op.type is OperationType.SCALE_OUT else SCALE_IN, op.updated_at)
        self.changed()

    # ---------------------------------------------------------------- queries
    def set_enabled(self, enabled: bool) -> None:
        if self._active.enabled != enabled:
            self._active.enabled = enabled
            self.emit(EventType.AUTOSCALER_DECISION, reason=f"autoscaler {'enabled' if enabled else 'disabled'}",
                           attributes={"action": NONE, "enabled": enabled})
            self.changed()

    def records(self, action: str | None, limit: int) -> tuple[list[state_pb2.AutoscalerAction], int]:
        matching = [h for h in reversed(self.history) if action is None or h.action == action]
        return matching[:limit], len(matching)


def history_entry(op: ScaleOperation, decision: Decision, now: float) -> state_pb2.AutoscalerAction:
    """The autoscaler history's record of ``decision``, which started ``op`` (``AutoscalerAction`` in the
    state schema); :meth:`AutoscalerLoop._finished` fills in how it ended."""
    return state_pb2.AutoscalerAction(
        operation_id=op.operation_id, action=decision.action, state=op.state.value, triggered_at=now,
        from_engines=op.engines_before, to_engines=op.num_replicas,
        delta=decision.delta if decision.action == SCALE_OUT else -decision.delta, reason=decision.reason,
        triggered_conditions=decision.triggered_conditions,
        metrics_snapshot={k: float(v) for k, v in decision.metrics_snapshot.items() if k != "time"})
