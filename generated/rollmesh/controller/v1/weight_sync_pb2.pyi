import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaSyncResult(_message.Message):
    __slots__ = ("replica_id", "ok", "error_message", "duration", "bytes_received")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    ok: bool
    error_message: str
    duration: _duration_pb2.Duration
    bytes_received: int
    def __init__(self, replica_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error_message: _Optional[str] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class WeightSyncResult(_message.Message):
    __slots__ = ("sync_id", "weight_version", "replica_results", "bytes_sent", "skipped_replica_ids", "bytes_saved", "duration", "source")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RESULTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SAVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    weight_version: int
    replica_results: _containers.RepeatedCompositeFieldContainer[ReplicaSyncResult]
    bytes_sent: int
    skipped_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    bytes_saved: int
    duration: _duration_pb2.Duration
    source: str
    def __init__(self, sync_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., replica_results: _Optional[_Iterable[_Union[ReplicaSyncResult, _Mapping]]] = ..., bytes_sent: _Optional[int] = ..., skipped_replica_ids: _Optional[_Iterable[str]] = ..., bytes_saved: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., source: _Optional[str] = ...) -> None: ...

class SyncWeightsRequest(_message.Message):
    __slots__ = ("weight_version", "replica_ids", "timeout", "request_id")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    timeout: _duration_pb2.Duration
    request_id: str
    def __init__(self, weight_version: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SyncWeightsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: WeightSyncResult
    def __init__(self, result: _Optional[_Union[WeightSyncResult, _Mapping]] = ...) -> None: ...
