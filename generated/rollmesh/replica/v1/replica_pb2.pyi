import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_ABORT: PauseMode

class Replica(_message.Message):
    __slots__ = ("replica_id", "node_id", "kind", "state", "weight_version", "slots", "memory_fraction", "backend", "model", "address", "launched_at", "sleep_level", "initial", "state_reason", "in_flight_requests", "engine_url", "data_address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_AT_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    node_id: str
    kind: _types_pb2.ReplicaKind
    state: _types_pb2.ReplicaState
    weight_version: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    memory_fraction: float
    backend: _types_pb2.EngineBackend
    model: str
    address: str
    launched_at: _timestamp_pb2.Timestamp
    sleep_level: _types_pb2.SleepLevel
    initial: bool
    state_reason: str
    in_flight_requests: int
    engine_url: str
    data_address: str
    def __init__(self, replica_id: _Optional[str] = ..., node_id: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., weight_version: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., memory_fraction: _Optional[float] = ..., backend: _Optional[_Union[_types_pb2.EngineBackend, str]] = ..., model: _Optional[str] = ..., address: _Optional[str] = ..., launched_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., sleep_level: _Optional[_Union[_types_pb2.SleepLevel, str]] = ..., initial: _Optional[bool] = ..., state_reason: _Optional[str] = ..., in_flight_requests: _Optional[int] = ..., engine_url: _Optional[str] = ..., data_address: _Optional[str] = ...) -> None: ...
