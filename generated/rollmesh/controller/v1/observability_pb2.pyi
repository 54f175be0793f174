import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.controller.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_sequence", "replica_ids", "types", "include_history")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    types: _containers.RepeatedScalarFieldContainer[_events_pb2.EventType]
    include_history: bool
    def __init__(self, from_sequence: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., types: _Optional[_Iterable[_Union[_events_pb2.EventType, str]]] = ..., include_history: _Optional[bool] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.LifecycleEvent
    def __init__(self, event: _Optional[_Union[_events_pb2.LifecycleEvent, _Mapping]] = ...) -> None: ...

class MetricsCycle(_message.Message):
    __slots__ = ("cycle", "global_step", "weight_version", "started_at", "ended_at", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    cycle: int
    global_step: int
    weight_version: int
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    values: _containers.ScalarMap[str, float]
    def __init__(self, cycle: _Optional[int] = ..., global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ("cycle", "from_cycle", "limit")
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    FROM_CYCLE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    cycle: int
    from_cycle: int
    limit: int
    def __init__(self, cycle: _Optional[int] = ..., from_cycle: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class GetMetricsResponse(_message.Message):
    __slots__ = ("cycles",)
    CYCLES_FIELD_NUMBER: _ClassVar[int]
    cycles: _containers.RepeatedCompositeFieldContainer[MetricsCycle]
    def __init__(self, cycles: _Optional[_Iterable[_Union[MetricsCycle, _Mapping]]] = ...) -> None: ...
