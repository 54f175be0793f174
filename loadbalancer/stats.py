"""Counters of the load balancer (GetStats and Prometheus)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from mesh_runtime.durations import set_seconds
from rollmesh.loadbalancer.v1 import routing_pb2


@dataclasses.dataclass
class Stats:
    """Monotonic counters since the balancer started (``in_flight`` is read live)."""

    requests_total: int = 0
    completed: int = 0
    failed: int = 0
    retries: int = 0
    resumes: int = 0
    regenerations: int = 0
    truncated_dropped: int = 0
    sticky_hits: int = 0
    sticky_migrations: int = 0
    no_replica_waits: int = 0
    outlier_ejections: int = 0
    cancelled: int = 0
    prefix_hits: int = 0
    prefix_spills: int = 0
    program_waits: int = 0
    programs_parked: int = 0
    since: float = dataclasses.field(default_factory=time.time)

    def to_proto(self, in_flight: int) -> routing_pb2.LoadBalancerStats:
        values = {k: v for k, v in dataclasses.asdict(self).items() if k != "since"}
        msg = routing_pb2.LoadBalancerStats(in_flight=in_flight, **values)
        set_seconds(msg.since, self.since)
        return msg

    def families(self, in_flight: int, completed: Any = None, routes: Any = None, sticky: int | None = None) -> list:
        """The counters as Prometheus families, plus the gauges of what the balancer holds now."""
        out: list[CounterMetricFamily | GaugeMetricFamily] = []
        for field_name, (name, text) in COUNTERS.items():
            family = CounterMetricFamily(name, text)
            family.add_metric([], getattr(self, field_name))
            out.append(family)
        out.append(GaugeMetricFamily("rollmesh_lb_requests_in_flight", "Requests in flight through the balancer",
                                     value=in_flight))
        if completed is not None:
            out.append(GaugeMetricFamily("rollmesh_lb_completed_cache_entries",
                                         "Completed-request records kept to answer repeated request ids",
                                         value=completed.entries))
            out.append(GaugeMetricFamily("rollmesh_lb_completed_cache_bytes",
                                         "Serialized size of the completed-request records", value=completed.bytes))
        if sticky is not None:
            out.append(GaugeMetricFamily("rollmesh_lb_sticky_sessions",
                                         "Session pins kept (bounded by max_sticky_sessions)", value=sticky))
        if routes is not None:
            gauge = GaugeMetricFamily("rollmesh_lb_replicas", "Replicas in the routing table, by routability",
                                      labels=["routable"])
            routable = sum(1 for ok in routes if ok)
            gauge.add_metric(["true"], routable)
            gauge.add_metric(["false"], len(routes) - routable)
            out.append(gauge)
        return out


COUNTERS = {
    "requests_total": ("rollmesh_lb_requests", "Generation requests received (a repeated completed id included)"),
    "completed": ("rollmesh_lb_requests_completed", "Generation requests that ended with a result"),
    "failed": ("rollmesh_lb_requests_failed", "Generation requests that ended with an error"),
    "cancelled": ("rollmesh_lb_requests_cancelled", "Generation requests their caller cancelled before they ended"),
    "retries": ("rollmesh_lb_retries", "Attempts after a request's first (aborts and failures alike)"),
    "resumes": ("rollmesh_lb_resumes", "Attempts that continued a request from the tokens it already had"),
    "regenerations": ("rollmesh_lb_regenerations", "Requests started over without their tokens (partial_rollout off)"),
    "truncated_dropped": ("rollmesh_lb_dropped_tokens", "Tokens dropped by regenerations"),
    "sticky_hits": ("rollmesh_lb_sticky_hits", "Requests routed to their session's replica"),
    "sticky_migrations": ("rollmesh_lb_sticky_migrations", "Sessions moved off a replica that was too loaded"),
    "prefix_hits": ("rollmesh_lb_prefix_hits", "Requests routed to a replica holding part of their prompt "
                    "(routing_policy prefix_cost or prefix_aware)"),
    "prefix_spills": ("rollmesh_lb_prefix_spills", "Requests whose prompt a replica held, routed elsewhere "
                      "because that replica was too loaded (routing_policy prefix_cost or prefix_aware)"),
    "program_waits": ("rollmesh_lb_program_waits", "Times a session's program waited for KV room on a replica "
                      "(program_admission)"),
    "programs_parked": ("rollmesh_lb_programs_parked", "Programs whose KV hold was released to keep a replica "
                        "within its KV budget (program_admission)"),
    "no_replica_waits": ("rollmesh_lb_no_replica_waits", "Times a request waited because no replica was eligible"),
    "outlier_ejections": ("rollmesh_lb_outlier_ejections", "Replicas ejected from picks after consecutive failures"),
}
"""Stats field -> (Prometheus counter name without _total, help)."""
