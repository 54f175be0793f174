import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.controller.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HybridState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HYBRID_STATE_UNSPECIFIED: _ClassVar[HybridState]
    HYBRID_STATE_STANDALONE_ONLY: _ClassVar[HybridState]
    HYBRID_STATE_HYBRID_ACTIVE: _ClassVar[HybridState]

class StepCall(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_CALL_UNSPECIFIED: _ClassVar[StepCall]
    STEP_CALL_BEGIN_TRAINING_STEP: _ClassVar[StepCall]
    STEP_CALL_RELEASE_HYBRID_REPLICAS: _ClassVar[StepCall]
    STEP_CALL_COMPLETE_TRAINING_STEP: _ClassVar[StepCall]
HYBRID_STATE_UNSPECIFIED: HybridState
HYBRID_STATE_STANDALONE_ONLY: HybridState
HYBRID_STATE_HYBRID_ACTIVE: HybridState
STEP_CALL_UNSPECIFIED: StepCall
STEP_CALL_BEGIN_TRAINING_STEP: StepCall
STEP_CALL_RELEASE_HYBRID_REPLICAS: StepCall
STEP_CALL_COMPLETE_TRAINING_STEP: StepCall

class ConcurrencySample(_message.Message):
    __slots__ = ("time", "active_tasks", "capacity")
    TIME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TASKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    time: _timestamp_pb2.Timestamp
    active_tasks: int
    capacity: int
    def __init__(self, time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., active_tasks: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("required_samples", "trigger_parameter_sync_step", "total_generated_samples", "expected_samples", "buffer_samples", "step_wait_times", "step_wait_samples", "queue_size", "timing_raw", "train_compute_time", "train_allocated_time", "step_generated_samples", "rollout_concurrency", "samples_consumed", "samples_dropped")
    class TimingRawEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _duration_pb2.Duration
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...
    REQUIRED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_PARAMETER_SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GENERATED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_WAIT_TIMES_FIELD_NUMBER: _ClassVar[int]
    STEP_WAIT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMING_RAW_FIELD_NUMBER: _ClassVar[int]
    TRAIN_COMPUTE_TIME_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ALLOCATED_TIME_FIELD_NUMBER: _ClassVar[int]
    STEP_GENERATED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    required_samples: int
    trigger_parameter_sync_step: int
    total_generated_samples: int
    expected_samples: int
    buffer_samples: float
    step_wait_times: _containers.RepeatedCompositeFieldContainer[_duration_pb2.Duration]
    step_wait_samples: _containers.RepeatedScalarFieldContainer[int]
    queue_size: int
    timing_raw: _containers.MessageMap[str, _duration_pb2.Duration]
    train_compute_time: _duration_pb2.Duration
    train_allocated_time: _duration_pb2.Duration
    step_generated_samples: int
    rollout_concurrency: _containers.RepeatedCompositeFieldContainer[ConcurrencySample]
    samples_consumed: int
    samples_dropped: int
    def __init__(self, required_samples: _Optional[int] = ..., trigger_parameter_sync_step: _Optional[int] = ..., total_generated_samples: _Optional[int] = ..., expected_samples: _Optional[int] = ..., buffer_samples: _Optional[float] = ..., step_wait_times: _Optional[_Iterable[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]]] = ..., step_wait_samples: _Optional[_Iterable[int]] = ..., queue_size: _Optional[int] = ..., timing_raw: _Optional[_Mapping[str, _duration_pb2.Duration]] = ..., train_compute_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., train_allocated_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., step_generated_samples: _Optional[int] = ..., rollout_concurrency: _Optional[_Iterable[_Union[ConcurrencySample, _Mapping]]] = ..., samples_consumed: _Optional[int] = ..., samples_dropped: _Optional[int] = ...) -> None: ...

class BeginTrainingStepRequest(_message.Message):
    __slots__ = ("global_step", "report")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    report: StepReport
    def __init__(self, global_step: _Optional[int] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class BeginTrainingStepResponse(_message.Message):
    __slots__ = ("deactivate", "wait_samples", "wait_timeout", "hybrid_state", "next_call")
    DEACTIVATE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    deactivate: bool
    wait_samples: int
    wait_timeout: _duration_pb2.Duration
    hybrid_state: HybridState
    next_call: StepCall
    def __init__(self, deactivate: _Optional[bool] = ..., wait_samples: _Optional[int] = ..., wait_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., hybrid_state: _Optional[_Union[HybridState, str]] = ..., next_call: _Optional[_Union[StepCall, str]] = ...) -> None: ...

class ReleaseHybridReplicasRequest(_message.Message):
    __slots__ = ("global_step", "buffered_samples", "waited", "wait_expired")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    WAIT_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    buffered_samples: int
    waited: _duration_pb2.Duration
    wait_expired: bool
    def __init__(self, global_step: _Optional[int] = ..., buffered_samples: _Optional[int] = ..., waited: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., wait_expired: _Optional[bool] = ...) -> None: ...

class ReleaseHybridReplicasResponse(_message.Message):
    __slots__ = ("released_replica_ids", "failed_replica_ids", "duration", "aborted_requests", "hybrid_state", "next_call")
    RELEASED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    released_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    duration: _duration_pb2.Duration
    aborted_requests: int
    hybrid_state: HybridState
    next_call: StepCall
    def __init__(self, released_replica_ids: _Optional[_Iterable[str]] = ..., failed_replica_ids: _Optional[_Iterable[str]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., aborted_requests: _Optional[int] = ..., hybrid_state: _Optional[_Union[HybridState, str]] = ..., next_call: _Optional[_Union[StepCall, str]] = ...) -> None: ...

class CompleteTrainingStepRequest(_message.Message):
    __slots__ = ("global_step", "weight_version", "report")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    weight_version: int
    report: StepReport
    def __init__(self, global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class CompleteTrainingStepResponse(_message.Message):
    __slots__ = ("standalone_sync", "hybrid_activated", "hybrid_sync_skipped", "hybrid_sync", "bytes_sent", "bytes_saved", "rebalanced", "deactivate_ratio", "hybrid_state", "next_call", "activation_duration", "rebalanced_requests")
    STANDALONE_SYNC_FIELD_NUMBER: _ClassVar[int]
    HYBRID_ACTIVATED_FIELD_NUMBER: _ClassVar[int]
    HYBRID_SYNC_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    HYBRID_SYNC_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SAVED_FIELD_NUMBER: _ClassVar[int]
    REBALANCED_FIELD_NUMBER: _ClassVar[int]
    DEACTIVATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DURATION_FIELD_NUMBER: _ClassVar[int]
    REBALANCED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    standalone_sync: _weight_sync_pb2.WeightSyncResult
    hybrid_activated: bool
    hybrid_sync_skipped: bool
    hybrid_sync: _weight_sync_pb2.WeightSyncResult
    bytes_sent: int
    bytes_saved: int
    rebalanced: bool
    deactivate_ratio: float
    hybrid_state: HybridState
    next_call: StepCall
    activation_duration: _duration_pb2.Duration
    rebalanced_requests: int
    def __init__(self, standalone_sync: _Optional[_Union[_weight_sync_pb2.WeightSyncResult, _Mapping]] = ..., hybrid_activated: _Optional[bool] = ..., hybrid_sync_skipped: _Optional[bool] = ..., hybrid_sync: _Optional[_Union[_weight_sync_pb2.WeightSyncResult, _Mapping]] = ..., bytes_sent: _Optional[int] = ..., bytes_saved: _Optional[int] = ..., rebalanced: _Optional[bool] = ..., deactivate_ratio: _Optional[float] = ..., hybrid_state: _Optional[_Union[HybridState, str]] = ..., next_call: _Optional[_Union[StepCall, str]] = ..., activation_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., rebalanced_requests: _Optional[int] = ...) -> None: ...

class GetSchedulerStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSchedulerStateResponse(_message.Message):
    __slots__ = ("enabled", "hybrid_state", "policy_name", "policy_parameters", "deactivate_ratio", "switch_cost", "per_sample_time", "next_call", "last_global_step", "activations", "deactivations", "only_hybrid", "enable_rebalance", "last_activate_duration", "last_deactivate_duration", "hybrid_replica_ids")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEACTIVATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    SWITCH_COST_FIELD_NUMBER: _ClassVar[int]
    PER_SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    LAST_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    DEACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    ONLY_HYBRID_FIELD_NUMBER: _ClassVar[int]
    ENABLE_REBALANCE_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVATE_DURATION_FIELD_NUMBER: _ClassVar[int]
    LAST_DEACTIVATE_DURATION_FIELD_NUMBER: _ClassVar[int]
    HYBRID_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    hybrid_state: HybridState
    policy_name: str
    policy_parameters: _struct_pb2.Struct
    deactivate_ratio: float
    switch_cost: _duration_pb2.Duration
    per_sample_time: _duration_pb2.Duration
    next_call: StepCall
    last_global_step: int
    activations: int
    deactivations: int
    only_hybrid: bool
    enable_rebalance: bool
    last_activate_duration: _duration_pb2.Duration
    last_deactivate_duration: _duration_pb2.Duration
    hybrid_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: _Optional[bool] = ..., hybrid_state: _Optional[_Union[HybridState, str]] = ..., policy_name: _Optional[str] = ..., policy_parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., deactivate_ratio: _Optional[float] = ..., switch_cost: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., per_sample_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., next_call: _Optional[_Union[StepCall, str]] = ..., last_global_step: _Optional[int] = ..., activations: _Optional[int] = ..., deactivations: _Optional[int] = ..., only_hybrid: _Optional[bool] = ..., enable_rebalance: _Optional[bool] = ..., last_activate_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., last_deactivate_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., hybrid_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...
