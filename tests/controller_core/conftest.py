"""Fixtures for the controller-core tests: a small mesh with fake ports and a fake clock."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest

from controller.core import (
    CycleMetrics,
    DynamicResourceController,
    EventLog,
    EventType,
    ReplicaKind,
    ReplicaRegistry,
    ReplicaSpec,
    ReplicaState,
    SchedulingConfig,
    StepReport,
)

from .fakes import FakeClock, FakeReplicas, FakeRouting, FakeWeights

S, K = ReplicaState, ReplicaKind

# required_samples = 8 x 4 = 32; step_required_samples = 32 x 4 = 128
BASE_CONFIG = {"use_dynamic_resource_scheduling": True, "ppo_mini_batch_size": 8, "require_batches": 4,
               "trigger_parameter_sync_step": 4}
LAGGING = {"expected_samples": 128, "buffer_samples": 12, "total_generated_samples": 100}   # gap 40
AHEAD = {"expected_samples": 128, "buffer_samples": 12, "total_generated_samples": 200}     # gap -60


def report(**fields: Any) -> StepReport:
    return StepReport(**fields)


@dataclasses.dataclass
class Mesh:
    clock: FakeClock
    log: list
    events: EventLog
    registry: ReplicaRegistry
    routing: FakeRouting
    replicas: FakeReplicas
    weights: FakeWeights
    spans: list
    metrics: CycleMetrics
    ctrl: DynamicResourceController | None = None

    def controller(self, **config: Any) -> DynamicResourceController:
        policy = config.pop("policy", None)
        cfg = SchedulingConfig(**{**BASE_CONFIG, **config})
        self.ctrl = DynamicResourceController(cfg, registry=self.registry, routing=self.routing,
                                              replicas=self.replicas, weights=self.weights, clock=self.clock,
                                              emit=self.events.append, tracer=self.tracer, metrics=self.metrics,
                                              policy=policy)
        return self.ctrl

    def tracer(self, name: str, **attributes: Any):
        self.spans.append(name)
        return contextlib.nullcontext()

    def ops(self, start: int = 0) -> list[str]:
        """Port call names from ``start`` on, consecutive repeats collapsed."""
        names: list[str] = []
        for entry in self.log[start:]:
            if not names or names[-1] != entry[0]:
                names.append(entry[0])
        return names

    def state(self, rid: str) -> ReplicaState:
        return self.registry.get(rid).state

    def events_of(self, type_: EventType) -> list:
        return [e for e in self.events.since(0)[0] if e.type is type_]


def build_mesh() -> Mesh:
    clock = FakeClock(1000.0)
    log: list = []
    events = EventLog(clock, max_events=100_000)
    registry = ReplicaRegistry(clock=clock, emit=events.append, lease_ttl_s=30)
    registry.register_node("s0", "s0:1", replicas=[ReplicaSpec("s1", K.STANDALONE, S.ACTIVE, initial=True),
                                                   ReplicaSpec("s2", K.STANDALONE, S.ACTIVE, initial=True)])
    registry.register_node("t1", "t1:1", replicas=[ReplicaSpec("h1", K.HYBRID, S.SLEEPING)])
    registry.register_node("t2", "t2:1", replicas=[ReplicaSpec("h2", K.HYBRID, S.SLEEPING)])
    return Mesh(clock=clock, log=log, events=events, registry=registry,
                routing=FakeRouting(log, clock, cost=0.5),
                replicas=FakeReplicas(log, clock, costs={"abort": 0.5, "sleep": 2.0, "wake": 1.0,
                                                         "resume": 0.25}),
                weights=FakeWeights(log, clock, model_bytes=1000, cost=3.0), spans=[],
                metrics=CycleMetrics(hybrid_gpus=2, standalone_gpus=2, concurrent_samples_per_replica=4,
                                     max_required_samples=64))


@pytest.fixture
def mesh() -> Mesh:
    return build_mesh()
