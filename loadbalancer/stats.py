"""Counters of the load balancer (GetStats and Prometheus)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from mesh_runtime.prometheus import Metric
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
    since: float = dataclasses.field(default_factory=time.time)

    def to_proto(self, in_flight: int) -> routing_pb2.LoadBalancerStats:
        values = {k: v for k, v in dataclasses.asdict(self).items() if k != "since"}
        msg = routing_pb2.LoadBalancerStats(in_flight=in_flight, **values)
        msg.since.FromNanoseconds(int(self.since * 1e9))
        return msg

    def metrics(self, in_flight: int, completed: Any = None) -> list[Metric]:
        out = [Metric(f"rollmesh_lb_{name}_total", f"Load balancer counter {name}", "counter").add(value)
               for name, value in dataclasses.asdict(self).items() if name != "since"]
        out.append(Metric("rollmesh_lb_in_flight", "Requests in flight through the balancer").add(in_flight))
        if completed is not None:
            out.append(Metric("rollmesh_lb_completed_cache_entries",
                              "Completed-request records kept for repeated request ids").add(completed.entries))
            out.append(Metric("rollmesh_lb_completed_cache_bytes",
                              "Serialized size of the completed-request records").add(completed.bytes))
        return out
