import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.controller.v1 import scaling_pb2 as _scaling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCALE_ACTION_UNSPECIFIED: _ClassVar[ScaleAction]
    SCALE_ACTION_NONE: _ClassVar[ScaleAction]
    SCALE_ACTION_SCALE_OUT: _ClassVar[ScaleAction]
    SCALE_ACTION_SCALE_IN: _ClassVar[ScaleAction]
SCALE_ACTION_UNSPECIFIED: ScaleAction
SCALE_ACTION_NONE: ScaleAction
SCALE_ACTION_SCALE_OUT: ScaleAction
SCALE_ACTION_SCALE_IN: ScaleAction

class AutoscalerMetrics(_message.Message):
    __slots__ = ("num_engines", "avg_token_usage", "total_queue_reqs", "queue_time_p95", "ttft_p95", "throughput", "throughput_variance", "collected_at")
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    AVG_TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_P95_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_AT_FIELD_NUMBER: _ClassVar[int]
    num_engines: int
    avg_token_usage: float
    total_queue_reqs: int
    queue_time_p95: _duration_pb2.Duration
    ttft_p95: _duration_pb2.Duration
    throughput: float
    throughput_variance: float
    collected_at: _timestamp_pb2.Timestamp
    def __init__(self, num_engines: _Optional[int] = ..., avg_token_usage: _Optional[float] = ..., total_queue_reqs: _Optional[int] = ..., queue_time_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ttft_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., throughput: _Optional[float] = ..., throughput_variance: _Optional[float] = ..., collected_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AutoscalerDecision(_message.Message):
    __slots__ = ("action", "delta", "reason", "decided_at", "triggered_conditions")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    TRIGGERED_CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    action: ScaleAction
    delta: int
    reason: str
    decided_at: _timestamp_pb2.Timestamp
    triggered_conditions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, action: _Optional[_Union[ScaleAction, str]] = ..., delta: _Optional[int] = ..., reason: _Optional[str] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., triggered_conditions: _Optional[_Iterable[str]] = ...) -> None: ...

class AutoscalerStatus(_message.Message):
    __slots__ = ("enabled", "running", "current_engines", "min_engines", "max_engines", "last_scale_time", "last_scale_action", "last_decision", "pending_operation_ids", "recent_metrics", "configured")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ENGINES_FIELD_NUMBER: _ClassVar[int]
    MIN_ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENGINES_FIELD_NUMBER: _ClassVar[int]
    LAST_SCALE_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_SCALE_ACTION_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    PENDING_OPERATION_IDS_FIELD_NUMBER: _ClassVar[int]
    RECENT_METRICS_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    running: bool
    current_engines: int
    min_engines: int
    max_engines: int
    last_scale_time: _timestamp_pb2.Timestamp
    last_scale_action: ScaleAction
    last_decision: AutoscalerDecision
    pending_operation_ids: _containers.RepeatedScalarFieldContainer[str]
    recent_metrics: AutoscalerMetrics
    configured: bool
    def __init__(self, enabled: _Optional[bool] = ..., running: _Optional[bool] = ..., current_engines: _Optional[int] = ..., min_engines: _Optional[int] = ..., max_engines: _Optional[int] = ..., last_scale_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_scale_action: _Optional[_Union[ScaleAction, str]] = ..., last_decision: _Optional[_Union[AutoscalerDecision, _Mapping]] = ..., pending_operation_ids: _Optional[_Iterable[str]] = ..., recent_metrics: _Optional[_Union[AutoscalerMetrics, _Mapping]] = ..., configured: _Optional[bool] = ...) -> None: ...

class AutoscalerCondition(_message.Message):
    __slots__ = ("name", "type", "triggered", "held_for", "required_for", "value", "threshold")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TRIGGERED_FIELD_NUMBER: _ClassVar[int]
    HELD_FOR_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FOR_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: ScaleAction
    triggered: bool
    held_for: _duration_pb2.Duration
    required_for: _duration_pb2.Duration
    value: float
    threshold: float
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[ScaleAction, str]] = ..., triggered: _Optional[bool] = ..., held_for: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., required_for: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., value: _Optional[float] = ..., threshold: _Optional[float] = ...) -> None: ...

class ScaleHistoryRecord(_message.Message):
    __slots__ = ("operation_id", "action", "state", "triggered_at", "completed_at", "from_engines", "to_engines", "delta", "reason", "triggered_conditions", "metrics_snapshot", "error_message")
    class MetricsSnapshotEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRIGGERED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    FROM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    TO_ENGINES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRIGGERED_CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    action: ScaleAction
    state: _scaling_pb2.OperationState
    triggered_at: _timestamp_pb2.Timestamp
    completed_at: _timestamp_pb2.Timestamp
    from_engines: int
    to_engines: int
    delta: int
    reason: str
    triggered_conditions: _containers.RepeatedScalarFieldContainer[str]
    metrics_snapshot: _containers.ScalarMap[str, float]
    error_message: str
    def __init__(self, operation_id: _Optional[str] = ..., action: _Optional[_Union[ScaleAction, str]] = ..., state: _Optional[_Union[_scaling_pb2.OperationState, str]] = ..., triggered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., from_engines: _Optional[int] = ..., to_engines: _Optional[int] = ..., delta: _Optional[int] = ..., reason: _Optional[str] = ..., triggered_conditions: _Optional[_Iterable[str]] = ..., metrics_snapshot: _Optional[_Mapping[str, float]] = ..., error_message: _Optional[str] = ...) -> None: ...

class GetAutoscalerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAutoscalerStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: AutoscalerStatus
    def __init__(self, status: _Optional[_Union[AutoscalerStatus, _Mapping]] = ...) -> None: ...

class SetAutoscalerEnabledRequest(_message.Message):
    __slots__ = ("enabled",)
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    def __init__(self, enabled: _Optional[bool] = ...) -> None: ...

class SetAutoscalerEnabledResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: AutoscalerStatus
    def __init__(self, status: _Optional[_Union[AutoscalerStatus, _Mapping]] = ...) -> None: ...

class GetAutoscalerConditionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAutoscalerConditionsResponse(_message.Message):
    __slots__ = ("conditions", "metrics")
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    conditions: _containers.RepeatedCompositeFieldContainer[AutoscalerCondition]
    metrics: AutoscalerMetrics
    def __init__(self, conditions: _Optional[_Iterable[_Union[AutoscalerCondition, _Mapping]]] = ..., metrics: _Optional[_Union[AutoscalerMetrics, _Mapping]] = ...) -> None: ...

class ListScaleHistoryRequest(_message.Message):
    __slots__ = ("limit", "action")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    limit: int
    action: ScaleAction
    def __init__(self, limit: _Optional[int] = ..., action: _Optional[_Union[ScaleAction, str]] = ...) -> None: ...

class ListScaleHistoryResponse(_message.Message):
    __slots__ = ("history", "total_count")
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    history: _containers.RepeatedCompositeFieldContainer[ScaleHistoryRecord]
    total_count: int
    def __init__(self, history: _Optional[_Iterable[_Union[ScaleHistoryRecord, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...
