"""Section 4.2 of the reference: ``dynamic_resource/rollout_resource_utilization`` and the idle ratio.

Written once and shared: the controller core (:mod:`controller.core.metrics`)
computes the metric per sync cycle from the trainer's reports, and the
trainer's rollouter computes it for its own window. Pure Python, no server
imports.

``rollout_resource_utilization = sum_k dt_k * min(cap_k, active_k) / sum_k
dt_k * cap_k`` with ``cap_k = min(servers_k * s, maxReq)`` held over ``[t_k,
t_k+1)``; intervals with ``cap_k = 0`` are skipped; 0.0 when no weight remains.
Placeholder seed points (capacity not yet known) take the first real capacity
that follows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ConcurrencyPoint:
    """From ``t`` until the next point, ``active_tasks`` ran against a capacity.

    Give either ``servers`` (then ``cap = min(servers * s, maxReq)``) or an
    already computed ``capacity`` (still clamped to ``maxReq``).
    """

    t: float
    active_tasks: int
    servers: int | None = None
    capacity: int | None = None
    placeholder: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _capacity_unknown(point: ConcurrencyPoint) -> bool:
    return (point.capacity == 0) if point.capacity is not None else not point.servers


def _as_point(point: ConcurrencyPoint | Sequence[float]) -> ConcurrencyPoint:
    if isinstance(point, ConcurrencyPoint):
        return point
    t, active, servers = point
    return ConcurrencyPoint(t=float(t), active_tasks=int(active), servers=int(servers))


def interval_capacities(history: Sequence[ConcurrencyPoint], concurrent_samples_per_replica: int,
                        max_required_samples: int) -> list[int]:
    """``cap_k`` of each point, with placeholder seeds corrected to the first real capacity."""
    caps = []
    for point in history:
        if point.capacity is not None:
            cap = point.capacity
        else:
            cap = (point.servers or 0) * concurrent_samples_per_replica
        caps.append(max(0, min(cap, max_required_samples)))
    real = None
    for index in range(len(history) - 1, -1, -1):
        if history[index].placeholder:
            caps[index] = real if real is not None else 0
        else:
            real = caps[index]
    return caps


def rollout_resource_utilization(history: Sequence[ConcurrencyPoint | Sequence[float]],
                                 concurrent_samples_per_replica: int, max_required_samples: int) -> float:
    """Capacity-time weighted share of capacity in use over the window (see module doc)."""
    points = [_as_point(p) for p in history]
    caps = interval_capacities(points, concurrent_samples_per_replica, max_required_samples)
    used = weight = 0.0
    for k in range(len(points) - 1):
        dt = points[k + 1].t - points[k].t
        if dt < 0:
            raise ValueError(f"concurrency history goes back in time at point {k + 1}: "
                             f"{points[k].t} -> {points[k + 1].t}")
        if caps[k] == 0 or dt == 0:
            continue
        used += dt * min(caps[k], max(0, points[k].active_tasks))
        weight += dt * caps[k]
    return used / weight if weight > 0 else 0.0


def rollout_idle_ratio(history: Sequence[ConcurrencyPoint | Sequence[float]]) -> float:
    """Share of the window in which no rollout task was active, over all idle windows."""
    points = [_as_point(p) for p in history]
    if len(points) < 2:
        return 0.0
    span = points[-1].t - points[0].t
    if span <= 0:
        return 0.0
    idle = sum(points[k + 1].t - points[k].t for k in range(len(points) - 1)
               if points[k].active_tasks <= 0)
    return idle / span
