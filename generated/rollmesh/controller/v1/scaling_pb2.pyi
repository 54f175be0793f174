import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperationType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_TYPE_UNSPECIFIED: _ClassVar[OperationType]
    OPERATION_TYPE_SCALE_OUT: _ClassVar[OperationType]
    OPERATION_TYPE_SCALE_IN: _ClassVar[OperationType]

class OperationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATE_UNSPECIFIED: _ClassVar[OperationState]
    OPERATION_STATE_PENDING: _ClassVar[OperationState]
    OPERATION_STATE_CREATING: _ClassVar[OperationState]
    OPERATION_STATE_CONNECTING: _ClassVar[OperationState]
    OPERATION_STATE_HEALTH_CHECKING: _ClassVar[OperationState]
    OPERATION_STATE_WEIGHT_SYNCING: _ClassVar[OperationState]
    OPERATION_STATE_READY: _ClassVar[OperationState]
    OPERATION_STATE_ACTIVE: _ClassVar[OperationState]
    OPERATION_STATE_DRAINING: _ClassVar[OperationState]
    OPERATION_STATE_REMOVING: _ClassVar[OperationState]
    OPERATION_STATE_COMPLETED: _ClassVar[OperationState]
    OPERATION_STATE_FAILED: _ClassVar[OperationState]
    OPERATION_STATE_CANCELLED: _ClassVar[OperationState]
    OPERATION_STATE_NOOP: _ClassVar[OperationState]

class PartialSuccessPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARTIAL_SUCCESS_POLICY_UNSPECIFIED: _ClassVar[PartialSuccessPolicy]
    PARTIAL_SUCCESS_POLICY_ROLLBACK_ALL: _ClassVar[PartialSuccessPolicy]
    PARTIAL_SUCCESS_POLICY_KEEP_PARTIAL: _ClassVar[PartialSuccessPolicy]
OPERATION_TYPE_UNSPECIFIED: OperationType
OPERATION_TYPE_SCALE_OUT: OperationType
OPERATION_TYPE_SCALE_IN: OperationType
OPERATION_STATE_UNSPECIFIED: OperationState
OPERATION_STATE_PENDING: OperationState
OPERATION_STATE_CREATING: OperationState
OPERATION_STATE_CONNECTING: OperationState
OPERATION_STATE_HEALTH_CHECKING: OperationState
OPERATION_STATE_WEIGHT_SYNCING: OperationState
OPERATION_STATE_READY: OperationState
OPERATION_STATE_ACTIVE: OperationState
OPERATION_STATE_DRAINING: OperationState
OPERATION_STATE_REMOVING: OperationState
OPERATION_STATE_COMPLETED: OperationState
OPERATION_STATE_FAILED: OperationState
OPERATION_STATE_CANCELLED: OperationState
OPERATION_STATE_NOOP: OperationState
PARTIAL_SUCCESS_POLICY_UNSPECIFIED: PartialSuccessPolicy
PARTIAL_SUCCESS_POLICY_ROLLBACK_ALL: PartialSuccessPolicy
PARTIAL_SUCCESS_POLICY_KEEP_PARTIAL: PartialSuccessPolicy

class OperationStateChange(_message.Message):
    __slots__ = ("state", "at", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: OperationState
    at: _timestamp_pb2.Timestamp
    reason: str
    def __init__(self, state: _Optional[_Union[OperationState, str]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ScaleOperation(_message.Message):
    __slots__ = ("operation_id", "type", "state", "model_name", "num_replicas", "engine_addresses", "replica_ids", "failed_replica_ids", "created_at", "updated_at", "error_message", "weight_version", "force", "dry_run", "timeout", "partial_success_policy", "state_history", "triggered_by", "request_id", "summary", "would_remove_replica_ids")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SUCCESS_POLICY_FIELD_NUMBER: _ClassVar[int]
    STATE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TRIGGERED_BY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    WOULD_REMOVE_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    type: OperationType
    state: OperationState
    model_name: str
    num_replicas: int
    engine_addresses: _containers.RepeatedScalarFieldContainer[str]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    error_message: str
    weight_version: int
    force: bool
    dry_run: bool
    timeout: _duration_pb2.Duration
    partial_success_policy: PartialSuccessPolicy
    state_history: _containers.RepeatedCompositeFieldContainer[OperationStateChange]
    triggered_by: str
    request_id: str
    summary: str
    would_remove_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, operation_id: _Optional[str] = ..., type: _Optional[_Union[OperationType, str]] = ..., state: _Optional[_Union[OperationState, str]] = ..., model_name: _Optional[str] = ..., num_replicas: _Optional[int] = ..., engine_addresses: _Optional[_Iterable[str]] = ..., replica_ids: _Optional[_Iterable[str]] = ..., failed_replica_ids: _Optional[_Iterable[str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error_message: _Optional[str] = ..., weight_version: _Optional[int] = ..., force: _Optional[bool] = ..., dry_run: _Optional[bool] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., partial_success_policy: _Optional[_Union[PartialSuccessPolicy, str]] = ..., state_history: _Optional[_Iterable[_Union[OperationStateChange, _Mapping]]] = ..., triggered_by: _Optional[str] = ..., request_id: _Optional[str] = ..., summary: _Optional[str] = ..., would_remove_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineAddresses(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleOutRequest(_message.Message):
    __slots__ = ("model_name", "num_replicas", "external", "timeout", "request_id", "dry_run", "partial_success_policy")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SUCCESS_POLICY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_replicas: int
    external: EngineAddresses
    timeout: _duration_pb2.Duration
    request_id: str
    dry_run: bool
    partial_success_policy: PartialSuccessPolicy
    def __init__(self, model_name: _Optional[str] = ..., num_replicas: _Optional[int] = ..., external: _Optional[_Union[EngineAddresses, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., request_id: _Optional[str] = ..., dry_run: _Optional[bool] = ..., partial_success_policy: _Optional[_Union[PartialSuccessPolicy, str]] = ...) -> None: ...

class ReplicaSelection(_message.Message):
    __slots__ = ("replica_ids", "engine_addresses")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ..., engine_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleInRequest(_message.Message):
    __slots__ = ("model_name", "num_replicas", "replicas", "force", "timeout", "dry_run", "request_id")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    num_replicas: int
    replicas: ReplicaSelection
    force: bool
    timeout: _duration_pb2.Duration
    dry_run: bool
    request_id: str
    def __init__(self, model_name: _Optional[str] = ..., num_replicas: _Optional[int] = ..., replicas: _Optional[_Union[ReplicaSelection, _Mapping]] = ..., force: _Optional[bool] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dry_run: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class ScaleResult(_message.Message):
    __slots__ = ("state", "replica_ids", "failed_replica_ids", "weight_version", "error_message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: OperationState
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    weight_version: int
    error_message: str
    def __init__(self, state: _Optional[_Union[OperationState, str]] = ..., replica_ids: _Optional[_Iterable[str]] = ..., failed_replica_ids: _Optional[_Iterable[str]] = ..., weight_version: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class CancelOperationsRequest(_message.Message):
    __slots__ = ("states", "dry_run")
    STATES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[OperationState]
    dry_run: bool
    def __init__(self, states: _Optional[_Iterable[_Union[OperationState, str]]] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class CancelOperationsResponse(_message.Message):
    __slots__ = ("cancelled_operation_ids",)
    CANCELLED_OPERATION_IDS_FIELD_NUMBER: _ClassVar[int]
    cancelled_operation_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cancelled_operation_ids: _Optional[_Iterable[str]] = ...) -> None: ...
