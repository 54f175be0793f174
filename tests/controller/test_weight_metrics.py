"""The controller's weight-copy metrics follow WEIGHT_SYNC_COMPLETED events (as the event log records them)."""

from __future__ import annotations

import types

from controller.core.events import EventType, LifecycleEvent
from controller.core.replicas import ReplicaRegistry
from controller.core.ports import ReplicaSyncOutcome, WeightSyncOutcome
from controller.prometheus import ControllerMetrics
from mesh_runtime.metrics import ServerMetrics


def sample(server: ServerMetrics, name: str, **labels: str) -> float | None:
    return server.registry.get_sample_value(name, labels or None)


def test_copies_bytes_and_density_of_a_delta_sync_are_counted():
    source = types.SimpleNamespace(   # what the scrape-time families read: an empty mesh
        metrics=types.SimpleNamespace(closed=[]), observe=lambda *a: None, registry=ReplicaRegistry(clock=lambda: 0.0),
        balancers=types.SimpleNamespace(records=lambda: []), events=[], hub=types.SimpleNamespace(sizes=lambda: []))
    server = ServerMetrics()
    metrics = ControllerMetrics(source, server)   # type: ignore[arg-type]
    outcome = WeightSyncOutcome(
        weight_version=4, bytes_sent=1200, delta_base_version=3, delta_bytes=1200, full_bytes=40000,
        delta_density=0.021, replica_results=(
            ReplicaSyncOutcome("s0", True, copy="delta", source="trainer-t"),
            ReplicaSyncOutcome("s1", True, copy="delta", source="trainer-t"),
            ReplicaSyncOutcome("r0", True, copy="peer", source="s0"),
            ReplicaSyncOutcome("r1", True, copy="full", source="trainer-t"),
            ReplicaSyncOutcome("r2", False, "checksum mismatch", copy="peer", source="s0")))
    attributes = {k: str(v) for k, v in outcome.attributes().items()}   # the event log keeps strings
    metrics.count_event(LifecycleEvent(1, 0.0, EventType.WEIGHT_SYNC_COMPLETED, weight_version=4,
                                       attributes=attributes))
    assert sample(server, "rollmesh_controller_weight_copies_total", copy="delta") == 2
    assert sample(server, "rollmesh_controller_weight_copies_total", copy="peer") == 1
    assert sample(server, "rollmesh_controller_weight_copies_total", copy="full") == 1
    assert sample(server, "rollmesh_controller_weight_delta_bytes", kind="delta") == 1200
    assert sample(server, "rollmesh_controller_weight_delta_bytes", kind="full") == 40000
    assert sample(server, "rollmesh_controller_weight_delta_density_ratio") == 0.021
    assert sample(server, "rollmesh_controller_weight_sync_bytes_total", kind="sent") == 1200

    full_only = WeightSyncOutcome(weight_version=5, bytes_sent=40000, full_bytes=40000, replica_results=(
        ReplicaSyncOutcome("s0", True, copy="full", source="trainer-t"),))
    metrics.count_event(LifecycleEvent(2, 0.0, EventType.WEIGHT_SYNC_COMPLETED, weight_version=5,
                                       attributes={k: str(v) for k, v in full_only.attributes().items()}))
    assert sample(server, "rollmesh_controller_weight_copies_total", copy="full") == 2
    assert sample(server, "rollmesh_controller_weight_delta_bytes", kind="delta") == 1200   # the last delta's
