"""The controller's I/O-free core: registry, state machines, policies, metrics.

Plain Python with an injected clock and injected async ports; the gRPC layer
(``controller/service.py``) and the simulator drive the same code. Nothing
here imports grpc, opens sockets or reads the real time.
"""

from .config import SchedulingConfig
from .context import DynamicScheduleContext
from .errors import (
                     CoreError,
                     FailedPreconditionError,
                     InvalidArgumentError,
                     InvalidTransition,
                     NotFoundError,
                     OutOfOrder,
                     PolicyError,
                     PortDeadlineExceeded,
                     PortUnavailable,
)
from .events import EventLog, EventType, LifecycleEvent
from .hybrid import DynamicResourceController, SchedulerState
from .metrics import ConcurrencyPoint, CycleMetrics, MicroStep
from .policies import (
                     DefaultDynamicSchedulePolicy,
                     DynamicSchedulePolicyBase,
                     FixedRatioDynamicSchedulePolicy,
                     StaticFullyAsyncPolicy,
                     StepOutcome,
                     create_policy,
                     register_policy,
                     resolve_policy,
)
from .ports import ReplicaCallResult, ReplicaSyncOutcome, WeightSyncOutcome
from .records import ReplicaKind, ReplicaRecord, ReplicaSpec, ReplicaState
from .replicas import ReplicaRegistry
from .steps import BeginDecision, CompleteResult, HybridState, ReleaseResult, StepCall, StepReport

__all__ = [
    "BeginDecision", "CompleteResult", "ConcurrencyPoint", "CoreError", "CycleMetrics",
    "DefaultDynamicSchedulePolicy", "DynamicResourceController", "DynamicScheduleContext",
    "DynamicSchedulePolicyBase", "EventLog", "EventType", "FailedPreconditionError",
    "FixedRatioDynamicSchedulePolicy", "HybridState", "InvalidArgumentError", "InvalidTransition",
    "LifecycleEvent", "MicroStep", "NotFoundError", "OutOfOrder", "PolicyError", "PortDeadlineExceeded",
    "PortUnavailable", "ReleaseResult", "ReplicaCallResult", "ReplicaKind", "ReplicaRecord", "ReplicaRegistry",
    "ReplicaSpec", "ReplicaState", "ReplicaSyncOutcome", "SchedulerState", "SchedulingConfig",
    "StaticFullyAsyncPolicy", "StepCall", "StepOutcome", "StepReport", "WeightSyncOutcome", "create_policy",
    "register_policy", "resolve_policy",
]
