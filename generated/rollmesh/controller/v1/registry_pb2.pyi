import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.common.v1 import load_pb2 as _load_pb2
from rollmesh.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRegistration(_message.Message):
    __slots__ = ("replica_id", "kind", "state", "weight_version", "slots", "memory_fraction", "initial", "engine_url", "data_address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    kind: _types_pb2.ReplicaKind
    state: _types_pb2.ReplicaState
    weight_version: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    memory_fraction: float
    initial: bool
    engine_url: str
    data_address: str
    def __init__(self, replica_id: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., weight_version: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., memory_fraction: _Optional[float] = ..., initial: _Optional[bool] = ..., engine_url: _Optional[str] = ..., data_address: _Optional[str] = ...) -> None: ...

class NodeRecord(_message.Message):
    __slots__ = ("node_id", "address", "slots_total", "backend", "model", "model_name", "agent_version", "registered_at", "lease_expires_at", "last_report_at", "lease_held", "replica_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    slots_total: int
    backend: _types_pb2.EngineBackend
    model: str
    model_name: str
    agent_version: str
    registered_at: _timestamp_pb2.Timestamp
    lease_expires_at: _timestamp_pb2.Timestamp
    last_report_at: _timestamp_pb2.Timestamp
    lease_held: bool
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., slots_total: _Optional[int] = ..., backend: _Optional[_Union[_types_pb2.EngineBackend, str]] = ..., model: _Optional[str] = ..., model_name: _Optional[str] = ..., agent_version: _Optional[str] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_report_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_held: _Optional[bool] = ..., replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaRecord(_message.Message):
    __slots__ = ("replica_id", "node_id", "address", "kind", "state", "weight_version", "initial", "added_by_operation_id", "intentionally_removed", "lease_expires_at", "last_report", "state_reason", "updated_at", "model_name", "slots", "memory_fraction", "engine_url", "data_address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    ADDED_BY_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    INTENTIONALLY_REMOVED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    node_id: str
    address: str
    kind: _types_pb2.ReplicaKind
    state: _types_pb2.ReplicaState
    weight_version: int
    initial: bool
    added_by_operation_id: str
    intentionally_removed: bool
    lease_expires_at: _timestamp_pb2.Timestamp
    last_report: _load_pb2.LoadReport
    state_reason: str
    updated_at: _timestamp_pb2.Timestamp
    model_name: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    memory_fraction: float
    engine_url: str
    data_address: str
    def __init__(self, replica_id: _Optional[str] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., weight_version: _Optional[int] = ..., initial: _Optional[bool] = ..., added_by_operation_id: _Optional[str] = ..., intentionally_removed: _Optional[bool] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_report: _Optional[_Union[_load_pb2.LoadReport, _Mapping]] = ..., state_reason: _Optional[str] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., model_name: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., memory_fraction: _Optional[float] = ..., engine_url: _Optional[str] = ..., data_address: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "address", "slots_total", "backend", "model", "model_name", "replicas", "agent_version")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    slots_total: int
    backend: _types_pb2.EngineBackend
    model: str
    model_name: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaRegistration]
    agent_version: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., slots_total: _Optional[int] = ..., backend: _Optional[_Union[_types_pb2.EngineBackend, str]] = ..., model: _Optional[str] = ..., model_name: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaRegistration, _Mapping]]] = ..., agent_version: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node_id", "lease_ttl", "load_report_interval", "accepted_replica_ids", "rejected_replica_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    LOAD_REPORT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_ttl: _duration_pb2.Duration
    load_report_interval: _duration_pb2.Duration
    accepted_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    rejected_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., load_report_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., accepted_replica_ids: _Optional[_Iterable[str]] = ..., rejected_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ("stopped_replica_ids",)
    STOPPED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    stopped_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stopped_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamLoadReportsRequest(_message.Message):
    __slots__ = ("node_id", "reports")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reports: _containers.RepeatedCompositeFieldContainer[_load_pb2.LoadReport]
    def __init__(self, node_id: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[_load_pb2.LoadReport, _Mapping]]] = ...) -> None: ...

class StreamLoadReportsResponse(_message.Message):
    __slots__ = ("load_report_interval", "lease_ttl", "lease_expires_at", "register_again")
    LOAD_REPORT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REGISTER_AGAIN_FIELD_NUMBER: _ClassVar[int]
    load_report_interval: _duration_pb2.Duration
    lease_ttl: _duration_pb2.Duration
    lease_expires_at: _timestamp_pb2.Timestamp
    register_again: bool
    def __init__(self, load_report_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., register_again: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "next_page_token")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRecord]
    next_page_token: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class GetNodeResponse(_message.Message):
    __slots__ = ("node", "replicas")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node: NodeRecord
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaRecord]
    def __init__(self, node: _Optional[_Union[NodeRecord, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaRecord, _Mapping]]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("kinds", "states", "node_id", "model_name", "page_size", "page_token")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[_types_pb2.ReplicaKind]
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.ReplicaState]
    node_id: str
    model_name: str
    page_size: int
    page_token: str
    def __init__(self, kinds: _Optional[_Iterable[_Union[_types_pb2.ReplicaKind, str]]] = ..., states: _Optional[_Iterable[_Union[_types_pb2.ReplicaState, str]]] = ..., node_id: _Optional[str] = ..., model_name: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "next_page_token")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaRecord]
    next_page_token: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class GetReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaRecord
    def __init__(self, replica: _Optional[_Union[ReplicaRecord, _Mapping]] = ...) -> None: ...

class BalancerRecord(_message.Message):
    __slots__ = ("balancer_id", "address", "version", "configured", "registered_at", "lease_expires_at", "lease_held", "routing_ready")
    BALANCER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    ROUTING_READY_FIELD_NUMBER: _ClassVar[int]
    balancer_id: str
    address: str
    version: str
    configured: bool
    registered_at: _timestamp_pb2.Timestamp
    lease_expires_at: _timestamp_pb2.Timestamp
    lease_held: bool
    routing_ready: bool
    def __init__(self, balancer_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., configured: _Optional[bool] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_held: _Optional[bool] = ..., routing_ready: _Optional[bool] = ...) -> None: ...

class RegisterBalancerRequest(_message.Message):
    __slots__ = ("balancer_id", "address", "version", "instance_id")
    BALANCER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    balancer_id: str
    address: str
    version: str
    instance_id: str
    def __init__(self, balancer_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterBalancerResponse(_message.Message):
    __slots__ = ("lease_ttl", "heartbeat_interval", "lease_expires_at", "routing_ready")
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_READY_FIELD_NUMBER: _ClassVar[int]
    lease_ttl: _duration_pb2.Duration
    heartbeat_interval: _duration_pb2.Duration
    lease_expires_at: _timestamp_pb2.Timestamp
    routing_ready: bool
    def __init__(self, lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., routing_ready: _Optional[bool] = ...) -> None: ...

class DeregisterBalancerRequest(_message.Message):
    __slots__ = ("balancer_id", "reason")
    BALANCER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    balancer_id: str
    reason: str
    def __init__(self, balancer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterBalancerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBalancersRequest(_message.Message):
    __slots__ = ("ready_only",)
    READY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ready_only: bool
    def __init__(self, ready_only: _Optional[bool] = ...) -> None: ...

class ListBalancersResponse(_message.Message):
    __slots__ = ("balancers",)
    BALANCERS_FIELD_NUMBER: _ClassVar[int]
    balancers: _containers.RepeatedCompositeFieldContainer[BalancerRecord]
    def __init__(self, balancers: _Optional[_Iterable[_Union[BalancerRecord, _Mapping]]] = ...) -> None: ...
