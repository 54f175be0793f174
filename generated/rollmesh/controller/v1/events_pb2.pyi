import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.common.v1 import types_pb2 as _types_pb2
from rollmesh.controller.v1 import scaling_pb2 as _scaling_pb2
from rollmesh.controller.v1 import scheduling_pb2 as _scheduling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_REPLICA_STATE_CHANGED: _ClassVar[EventType]
    EVENT_TYPE_CONTROLLER_STATE_CHANGED: _ClassVar[EventType]
    EVENT_TYPE_WEIGHT_SYNC_STARTED: _ClassVar[EventType]
    EVENT_TYPE_WEIGHT_SYNC_COMPLETED: _ClassVar[EventType]
    EVENT_TYPE_WEIGHT_SYNC_SKIPPED: _ClassVar[EventType]
    EVENT_TYPE_WEIGHT_SYNC_FAILED: _ClassVar[EventType]
    EVENT_TYPE_LEASE_EXPIRED: _ClassVar[EventType]
    EVENT_TYPE_NODE_REGISTERED: _ClassVar[EventType]
    EVENT_TYPE_NODE_DEREGISTERED: _ClassVar[EventType]
    EVENT_TYPE_OPERATION_STATE_CHANGED: _ClassVar[EventType]
    EVENT_TYPE_AUTOSCALER_DECISION: _ClassVar[EventType]
    EVENT_TYPE_STEP_PHASE: _ClassVar[EventType]
    EVENT_TYPE_WAIT_EXPIRED: _ClassVar[EventType]
    EVENT_TYPE_GAP: _ClassVar[EventType]
    EVENT_TYPE_REPLICA_EJECTED: _ClassVar[EventType]
    EVENT_TYPE_LEADER_CHANGED: _ClassVar[EventType]
    EVENT_TYPE_BALANCER_REGISTERED: _ClassVar[EventType]
    EVENT_TYPE_BALANCER_DEREGISTERED: _ClassVar[EventType]
    EVENT_TYPE_BALANCER_LEASE_EXPIRED: _ClassVar[EventType]
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_REPLICA_STATE_CHANGED: EventType
EVENT_TYPE_CONTROLLER_STATE_CHANGED: EventType
EVENT_TYPE_WEIGHT_SYNC_STARTED: EventType
EVENT_TYPE_WEIGHT_SYNC_COMPLETED: EventType
EVENT_TYPE_WEIGHT_SYNC_SKIPPED: EventType
EVENT_TYPE_WEIGHT_SYNC_FAILED: EventType
EVENT_TYPE_LEASE_EXPIRED: EventType
EVENT_TYPE_NODE_REGISTERED: EventType
EVENT_TYPE_NODE_DEREGISTERED: EventType
EVENT_TYPE_OPERATION_STATE_CHANGED: EventType
EVENT_TYPE_AUTOSCALER_DECISION: EventType
EVENT_TYPE_STEP_PHASE: EventType
EVENT_TYPE_WAIT_EXPIRED: EventType
EVENT_TYPE_GAP: EventType
EVENT_TYPE_REPLICA_EJECTED: EventType
EVENT_TYPE_LEADER_CHANGED: EventType
EVENT_TYPE_BALANCER_REGISTERED: EventType
EVENT_TYPE_BALANCER_DEREGISTERED: EventType
EVENT_TYPE_BALANCER_LEASE_EXPIRED: EventType

class LifecycleEvent(_message.Message):
    __slots__ = ("sequence", "time", "type", "replica_id", "node_id", "replica_kind", "from_state", "to_state", "reason", "trace_id", "span_id", "global_step", "weight_version", "operation_id", "attributes", "missed_events", "details", "from_replica_state", "to_replica_state", "from_operation_state", "to_operation_state", "from_hybrid_state", "to_hybrid_state")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_KIND_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    MISSED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FROM_REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    FROM_OPERATION_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_OPERATION_STATE_FIELD_NUMBER: _ClassVar[int]
    FROM_HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    time: _timestamp_pb2.Timestamp
    type: EventType
    replica_id: str
    node_id: str
    replica_kind: _types_pb2.ReplicaKind
    from_state: str
    to_state: str
    reason: str
    trace_id: str
    span_id: str
    global_step: int
    weight_version: int
    operation_id: str
    attributes: _containers.ScalarMap[str, str]
    missed_events: int
    details: _struct_pb2.Struct
    from_replica_state: _types_pb2.ReplicaState
    to_replica_state: _types_pb2.ReplicaState
    from_operation_state: _scaling_pb2.OperationState
    to_operation_state: _scaling_pb2.OperationState
    from_hybrid_state: _scheduling_pb2.HybridState
    to_hybrid_state: _scheduling_pb2.HybridState
    def __init__(self, sequence: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., type: _Optional[_Union[EventType, str]] = ..., replica_id: _Optional[str] = ..., node_id: _Optional[str] = ..., replica_kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., from_state: _Optional[str] = ..., to_state: _Optional[str] = ..., reason: _Optional[str] = ..., trace_id: _Optional[str] = ..., span_id: _Optional[str] = ..., global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., operation_id: _Optional[str] = ..., attributes: _Optional[_Mapping[str, str]] = ..., missed_events: _Optional[int] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., from_replica_state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., to_replica_state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., from_operation_state: _Optional[_Union[_scaling_pb2.OperationState, str]] = ..., to_operation_state: _Optional[_Union[_scaling_pb2.OperationState, str]] = ..., from_hybrid_state: _Optional[_Union[_scheduling_pb2.HybridState, str]] = ..., to_hybrid_state: _Optional[_Union[_scheduling_pb2.HybridState, str]] = ...) -> None: ...
