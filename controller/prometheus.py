"""The controller's Prometheus metrics: the mesh's state as gauges, closed sync cycles as histograms.

Each closed sync cycle's ``dynamic_resource/*`` and ``fully_async/*`` values
(which keep their names in ``GetMetrics``) are observed once, into a histogram
per value: times in seconds (``..._time_s`` -> ``..._time_seconds``),
utilizations and ratios as ``..._ratio``, so ``rate(x_sum[5m]) /
rate(x_count[5m])`` is their mean over cycles. ``mq_size`` is a size (a gauge
of the newest cycle) and the rollouter's per-step sample count is a counter.
Cycles restored from the state directory at start-up count as already observed.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mesh_runtime.metrics import LATENCY_BUCKETS, RATIO_BUCKETS, ServerMetrics

from .core import metrics as cycle_metrics
from .core.events import EventLog, LifecycleEvent

if TYPE_CHECKING:
    from .balancers import Balancers
    from .core.metrics import CycleMetrics
    from .core.replicas import ReplicaRegistry
    from .watchers import EventHub


class Observed(Protocol):
    """What the metrics read of the controller (its :class:`~controller.mesh.Mesh`, the leader's or a
    standby's copy): a typed port, not the whole mesh."""

    registry: ReplicaRegistry
    balancers: Balancers
    metrics: CycleMetrics
    events: EventLog
    hub: EventHub

    def observe(self, on_event: Callable[[LifecycleEvent], None],
                on_write: Callable[[float, bool], None]) -> None:
        """Call ``on_event`` with every event recorded from now on, ``on_write`` after every store batch."""
        ...

_GAUGES = {cycle_metrics.MQ_SIZE}
_HISTOGRAMS = (cycle_metrics.TRAIN_UTILIZATION, cycle_metrics.TRAIN_COMPUTE_TIME, cycle_metrics.TRAIN_ALLOCATED_TIME,
               cycle_metrics.ROLLOUT_UTILIZATION, cycle_metrics.RESOURCE_UTILIZATION,
               cycle_metrics.ROLLOUTER_IDLE_RATIO)
_COUNTERS = {cycle_metrics.STEP_GENERATED_SAMPLES: ("rollmesh_fully_async_rollouter_generated_samples",
                                                    "Samples the rollouter generated, summed over closed sync cycles")}


def prometheus_name(value_name: str) -> tuple[str, tuple[float, ...]]:
    """The histogram name and buckets of one cycle value, e.g. ``dynamic_resource/train_compute_time_s``."""
    base = "rollmesh_" + value_name.replace("/", "_")
    if base.endswith("_time_s"):
        return base.removesuffix("_s") + "_seconds", LATENCY_BUCKETS
    if base.endswith("_ratio"):
        return base, RATIO_BUCKETS
    if base.endswith("utilization"):
        return base + "_ratio", RATIO_BUCKETS
    return base, LATENCY_BUCKETS


def _number(value: Any) -> float:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return 0.0


class ControllerMetrics:
    """Registers the controller's metrics on ``server`` and observes cycles as they close."""

    def __init__(self, source: Observed, server: ServerMetrics) -> None:
        self._source = source
        self._server = server
        self._histograms: dict[str, Histogram] = {}
        self._sums: dict[str, float] = {}
        closed = source.metrics.closed
        self._observed = closed[-1].cycle if closed else 0
        server.on_scrape(self.families)   # first: it observes new cycles before the histograms below are read
        self._events = server.counter("rollmesh_controller_events", "Lifecycle events recorded, by type", ("type",))
        self._transitions = server.counter("rollmesh_controller_hybrid_transitions",
                                           "Hybrid replicas activated for rollout or released for training",
                                           ("transition",))
        self._syncs = server.counter("rollmesh_controller_weight_syncs",
                                     "Weight syncs by outcome (completed, failed, skipped hybrid syncs)", ("outcome",))
        self._sync_bytes = server.counter("rollmesh_controller_weight_sync_bytes",
                                          "Bytes the weight syncs sent, and the bytes skipped hybrid syncs saved",
                                          ("kind",))
        self._copies = server.counter("rollmesh_controller_weight_copies",
                                      "Replicas a weight sync brought to its version, by the copy they took: delta "
                                      "(the words that changed), full (from the trainer) or peer (a full copy from "
                                      "a replica)", ("copy",))
        self._delta_bytes = server.gauge("rollmesh_controller_weight_delta_bytes",
                                         "Bytes of the last delta sent, and of a full copy of its version", ("kind",))
        self._delta_density = server.gauge("rollmesh_controller_weight_delta_density_ratio",
                                           "Share of the words that changed in the last version sent as a delta")
        writes = server.counter("rollmesh_controller_store_writes",
                                "Batches written to the state store (SQLite or etcd), by outcome (ok, error)",
                                ("outcome",))
        write_time = server.histogram("rollmesh_controller_store_write_seconds",
                                      "Time to make one batch of state durable in the state store")
        for outcome in ("ok", "error"):
            writes.labels(outcome)

        def on_write(seconds: float, ok: bool) -> None:
            writes.labels("ok" if ok else "error").inc()
            if ok:
                write_time.observe(seconds)
        self._on_write = on_write
        for transition in ("activate", "deactivate"):
            self._transitions.labels(transition)
        for outcome in ("completed", "failed", "skipped"):
            self._syncs.labels(outcome)
        for kind in ("sent", "saved"):
            self._sync_bytes.labels(kind)
        for copy in ("delta", "full", "peer"):
            self._copies.labels(copy)
        for kind in ("delta", "full"):
            self._delta_bytes.labels(kind)
        self._cycles = server.counter("rollmesh_dynamic_resource_cycles", "Sync cycles closed since start-up")
        for name in _HISTOGRAMS:
            self._histogram(name)
        self.bind(source)

    def bind(self, source: Observed) -> None:
        """Observe ``source`` from now on (a standby's refreshed copy, a promoted leader's mesh): its store's
        writes, its events, its cycles from the newest it has."""
        self._source = source
        source.observe(self.count_event, self._on_write)
        closed = source.metrics.closed
        self._observed = max(self._observed, closed[-1].cycle if closed else 0)

    def count_event(self, event: LifecycleEvent) -> None:
        kind, attrs = event.type.value, event.attributes or {}
        self._events.labels(kind).inc()
        if kind == "CONTROLLER_STATE_CHANGED" and event.from_state:
            if event.to_state == "HYBRID_STATE_HYBRID_ACTIVE":
                self._transitions.labels("activate").inc()
            elif event.to_state == "HYBRID_STATE_STANDALONE_ONLY":
                self._transitions.labels("deactivate").inc()
        elif kind == "WEIGHT_SYNC_COMPLETED":
            self._syncs.labels("completed").inc()
            self._sync_bytes.labels("sent").inc(_number(attrs.get("bytes_sent")))
            peer = _number(attrs.get("peer_copies"))
            self._copies.labels("delta").inc(_number(attrs.get("delta_copies")))
            self._copies.labels("peer").inc(peer)
            self._copies.labels("full").inc(max(0.0, _number(attrs.get("full_copies")) - peer))
            if _number(attrs.get("delta_bytes")) > 0:   # a delta went out
                self._delta_bytes.labels("delta").set(_number(attrs.get("delta_bytes")))
                self._delta_bytes.labels("full").set(_number(attrs.get("full_bytes")))
                self._delta_density.set(_number(attrs.get("delta_density")))
        elif kind == "WEIGHT_SYNC_FAILED":
            self._syncs.labels("failed").inc()
        elif kind == "WEIGHT_SYNC_SKIPPED":
            self._syncs.labels("skipped").inc()
            self._sync_bytes.labels("saved").inc(_number(attrs.get("bytes_saved")))

    def observe_closed_cycles(self) -> None:
        for cycle in self._source.metrics.closed:
            if cycle.cycle <= self._observed:
                continue
            self._observed = cycle.cycle
            self._cycles.inc()
            for name, value in cycle.values.items():
                if name in _GAUGES:
                    continue
                if name in _COUNTERS:
                    self._sums[name] = self._sums.get(name, 0.0) + float(value)
                    continue
                self._histogram(name).observe(float(value))

    def _histogram(self, name: str) -> Histogram:
        histogram = self._histograms.get(name)
        if histogram is None:   # a value this code does not list yet shows from the next scrape on
            metric, buckets = prometheus_name(name)
            histogram = self._histograms[name] = self._server.histogram(
                metric, f"{name} of each closed sync cycle (the reference's metric)", buckets=buckets)
        return histogram

    def families(self) -> list:
        self.observe_closed_cycles()
        registry = self._source.registry
        out: list[CounterMetricFamily | GaugeMetricFamily] = []
        replicas = GaugeMetricFamily("rollmesh_controller_replicas", "Replicas in the registry, by kind and state",
                                     labels=["kind", "state"])
        for (kind, state), count in sorted(Tally((r.kind.value, r.state.value) for r in registry.replicas()).items()):
            replicas.add_metric([kind, state], count)
        out.append(replicas)
        nodes = GaugeMetricFamily("rollmesh_controller_nodes", "Registered nodes, by whether they hold their lease",
                                  labels=["lease_held"])
        held = sum(1 for n in registry.nodes() if n.lease_held)
        nodes.add_metric(["true"], held)
        nodes.add_metric(["false"], len(registry.nodes()) - held)
        out.append(nodes)
        balancers = GaugeMetricFamily("rollmesh_controller_balancers", "Load balancers kept in line (configured and "
                                      "registered), by whether clients are sent to them (table filled, answering)",
                                      labels=["ready"])
        records = self._source.balancers.records()
        ready = sum(1 for b in records if b.routing_ready and b.lease_held)
        balancers.add_metric(["true"], ready)
        balancers.add_metric(["false"], len(records) - ready)
        out.append(balancers)
        for name, (metric, text) in _COUNTERS.items():
            family = CounterMetricFamily(metric, text)
            family.add_metric([], self._sums.get(name, 0.0))
            out.append(family)
        out.append(GaugeMetricFamily("rollmesh_controller_event_history_events",
                                     "Lifecycle events retained for replay (event_retention, event_retention_s, "
                                     "event_retention_max)", value=len(self._source.events)))
        queued = self._source.hub.sizes()
        out.append(GaugeMetricFamily("rollmesh_controller_event_watchers", "Open WatchEvents streams",
                                     value=len(queued)))
        out.append(GaugeMetricFamily("rollmesh_controller_event_watcher_queue_max_events",
                                     "Events queued for the most backed-up WatchEvents stream (bounded by "
                                     "watcher_queue_size)", value=max(queued, default=0)))
        latest = self._source.metrics.closed[-1] if self._source.metrics.closed else None
        if latest is not None and cycle_metrics.MQ_SIZE in latest.values:
            out.append(GaugeMetricFamily("rollmesh_dynamic_resource_mq_size",
                                         "Message-queue size at the newest closed sync cycle",
                                         value=latest.values[cycle_metrics.MQ_SIZE]))
        return out
