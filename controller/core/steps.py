"""Types of the step protocol: hybrid state, expected call, report and answers.

They mirror ``rollmesh/controller/v1/scheduling.proto`` (seconds as floats
instead of ``Duration``), and convert to and from plain dicts so the
controller can persist the answers it gave for the current step - a retried
call after a controller restart gets the same answer.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .errors import InvalidArgumentError
from .metrics import ConcurrencyPoint
from .ports import WeightSyncOutcome


class HybridState(enum.Enum):
    """``STANDALONE_ONLY <-> HYBRID_ACTIVE``."""

    STANDALONE_ONLY = "STANDALONE_ONLY"
    HYBRID_ACTIVE = "HYBRID_ACTIVE"

    @property
    def proto_name(self) -> str:
        return f"HYBRID_STATE_{self.value}"


class StepCall(enum.Enum):
    """A call of the step protocol; ``label`` is the RPC name."""

    BEGIN_TRAINING_STEP = "BeginTrainingStep"
    RELEASE_HYBRID_REPLICAS = "ReleaseHybridReplicas"
    COMPLETE_TRAINING_STEP = "CompleteTrainingStep"

    @property
    def label(self) -> str:
        return self.value

    @property
    def proto_name(self) -> str:
        return f"STEP_CALL_{self.name}"


@dataclasses.dataclass
class StepReport:
    """What the trainer reports at BeginTrainingStep / CompleteTrainingStep (``StepReport``).

    ``required_samples`` and ``trigger_parameter_sync_step`` of 0 mean "use
    the configured values". ``train_compute_time_s`` None means "derive it
    from ``timing_raw``".
    """

    required_samples: int = 0
    trigger_parameter_sync_step: int = 0
    total_generated_samples: int = 0
    expected_samples: int = 0
    buffer_samples: float = 0.0
    step_wait_times: list[float] = dataclasses.field(default_factory=list)
    step_wait_samples: list[int] = dataclasses.field(default_factory=list)
    queue_size: int = 0
    timing_raw: dict[str, float] = dataclasses.field(default_factory=dict)
    train_compute_time_s: float | None = None
    train_allocated_time_s: float = 0.0
    step_generated_samples: int = 0
    rollout_concurrency: list[ConcurrencyPoint] = dataclasses.field(default_factory=list)
    samples_consumed: int = 0
    samples_dropped: int = 0

    def validate(self) -> None:
        """Raise InvalidArgumentError for negative counts or unequal wait lists."""
        for name in ("required_samples", "trigger_parameter_sync_step", "total_generated_samples",
                     "expected_samples", "buffer_samples", "queue_size", "step_generated_samples",
                     "samples_consumed", "samples_dropped"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"report.{name} must be >= 0, got {getattr(self, name)}")
        if not math.isfinite(self.buffer_samples):
            raise InvalidArgumentError(f"report.buffer_samples must be a finite number, got {self.buffer_samples}")
        if len(self.step_wait_times) != len(self.step_wait_samples):
            raise InvalidArgumentError(
                f"report.step_wait_times ({len(self.step_wait_times)} entries) and "
                f"report.step_wait_samples ({len(self.step_wait_samples)}) must be parallel lists")
        if any(t < 0 for t in self.step_wait_times) or any(n < 0 for n in self.step_wait_samples):
            raise InvalidArgumentError("report.step_wait_times and step_wait_samples must be >= 0")
        if self.train_allocated_time_s < 0 or (self.train_compute_time_s or 0.0) < 0:
            raise InvalidArgumentError("report train times must be >= 0")


@dataclasses.dataclass(frozen=True)
class BeginDecision:
    """Answer of BeginTrainingStep (policy points 1 and 2)."""

    global_step: int
    deactivate: bool
    wait_samples: int
    wait_timeout_s: float
    hybrid_state: HybridState
    next_call: StepCall

    def to_document(self) -> state_pb2.BeginAnswer:
        return state_pb2.BeginAnswer(global_step=self.global_step, deactivate=self.deactivate,
                                     wait_samples=self.wait_samples, wait_timeout_s=self.wait_timeout_s,
                                     hybrid_state=self.hybrid_state.value, next_call=self.next_call.value)

    @classmethod
    def from_document(cls, doc: state_pb2.BeginAnswer) -> BeginDecision:
        return cls(global_step=doc.global_step, deactivate=doc.deactivate, wait_samples=doc.wait_samples,
                   wait_timeout_s=doc.wait_timeout_s, hybrid_state=HybridState(doc.hybrid_state),
                   next_call=StepCall(doc.next_call))


@dataclasses.dataclass(frozen=True)
class ReleaseResult:
    """Answer of ReleaseHybridReplicas (deactivation)."""

    global_step: int
    released_replica_ids: tuple[str, ...]
    failed_replica_ids: tuple[str, ...]
    duration_s: float
    aborted_requests: int
    wait_expired: bool
    hybrid_state: HybridState
    next_call: StepCall

    def to_document(self) -> state_pb2.ReleaseAnswer:
        return state_pb2.ReleaseAnswer(
            global_step=self.global_step, released_replica_ids=self.released_replica_ids,
            failed_replica_ids=self.failed_replica_ids, duration_s=self.duration_s,
            aborted_requests=self.aborted_requests, wait_expired=self.wait_expired,
            hybrid_state=self.hybrid_state.value, next_call=self.next_call.value)

    @classmethod
    def from_document(cls, doc: state_pb2.ReleaseAnswer) -> ReleaseResult:
        return cls(global_step=doc.global_step, released_replica_ids=tuple(doc.released_replica_ids),
                   failed_replica_ids=tuple(doc.failed_replica_ids), duration_s=doc.duration_s,
                   aborted_requests=doc.aborted_requests, wait_expired=doc.wait_expired,
                   hybrid_state=HybridState(doc.hybrid_state), next_call=StepCall(doc.next_call))


@dataclasses.dataclass(frozen=True)
class CompleteResult:
    """Answer of CompleteTrainingStep (sync, points 3-5)."""

    global_step: int
    standalone_sync: WeightSyncOutcome | None
    hybrid_activated: bool
    hybrid_sync_skipped: bool
    hybrid_sync: WeightSyncOutcome | None
    bytes_sent: int
    bytes_saved: int
    rebalanced: bool
    deactivate_ratio: float
    hybrid_state: HybridState
    next_call: StepCall
    activation_duration_s: float | None = None
    failed_replica_ids: tuple[str, ...] = ()
    rebalanced_requests: int = 0
    """In-flight requests the rebalance after the activation moved to another replica."""

    def to_document(self) -> state_pb2.CompleteAnswer:
        return state_pb2.CompleteAnswer(
            global_step=self.global_step,
            standalone_sync=self.standalone_sync.to_document() if self.standalone_sync else None,
            hybrid_activated=self.hybrid_activated, hybrid_sync_skipped=self.hybrid_sync_skipped,
            hybrid_sync=self.hybrid_sync.to_document() if self.hybrid_sync else None, bytes_sent=self.bytes_sent,
            bytes_saved=self.bytes_saved, rebalanced=self.rebalanced, deactivate_ratio=self.deactivate_ratio,
            hybrid_state=self.hybrid_state.value, next_call=self.next_call.value,
            activation_duration_s=self.activation_duration_s, failed_replica_ids=self.failed_replica_ids,
            rebalanced_requests=self.rebalanced_requests)

    @classmethod
    def from_document(cls, doc: state_pb2.CompleteAnswer) -> CompleteResult:
        standalone = doc.standalone_sync if doc.HasField("standalone_sync") else None
        hybrid = doc.hybrid_sync if doc.HasField("hybrid_sync") else None
        return cls(
            global_step=doc.global_step,
            standalone_sync=WeightSyncOutcome.from_document(standalone) if standalone is not None else None,
            hybrid_activated=doc.hybrid_activated, hybrid_sync_skipped=doc.hybrid_sync_skipped,
            hybrid_sync=WeightSyncOutcome.from_document(hybrid) if hybrid is not None else None, bytes_sent=doc.bytes_sent, bytes_saved=doc.bytes_saved,
            rebalanced=doc.rebalanced, deactivate_ratio=doc.deactivate_ratio,
            hybrid_state=HybridState(doc.hybrid_state), next_call=StepCall(doc.next_call),
            activation_duration_s=doc.activation_duration_s if doc.HasField("activation_duration_s") else None,
            failed_replica_ids=tuple(doc.failed_replica_ids), rebalanced_requests=doc.rebalanced_requests)
