import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttemptOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTEMPT_OUTCOME_UNSPECIFIED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_COMPLETED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_ABORTED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_UNAVAILABLE: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_FAILED: _ClassVar[AttemptOutcome]
ATTEMPT_OUTCOME_UNSPECIFIED: AttemptOutcome
ATTEMPT_OUTCOME_COMPLETED: AttemptOutcome
ATTEMPT_OUTCOME_ABORTED: AttemptOutcome
ATTEMPT_OUTCOME_UNAVAILABLE: AttemptOutcome
ATTEMPT_OUTCOME_FAILED: AttemptOutcome

class ReplicaEndpoint(_message.Message):
    __slots__ = ("replica_id", "address", "kind", "weight_version", "node_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    kind: _types_pb2.ReplicaKind
    weight_version: int
    node_id: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., weight_version: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class RoutedReplica(_message.Message):
    __slots__ = ("endpoint", "in_flight", "sticky_sessions", "completed", "failed", "routable", "unroutable_reason", "added_at", "consecutive_failures", "ejected_until", "ejections")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STICKY_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    UNROUTABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    ADDED_AT_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EJECTED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    EJECTIONS_FIELD_NUMBER: _ClassVar[int]
    endpoint: ReplicaEndpoint
    in_flight: int
    sticky_sessions: int
    completed: int
    failed: int
    routable: bool
    unroutable_reason: str
    added_at: _timestamp_pb2.Timestamp
    consecutive_failures: int
    ejected_until: _timestamp_pb2.Timestamp
    ejections: int
    def __init__(self, endpoint: _Optional[_Union[ReplicaEndpoint, _Mapping]] = ..., in_flight: _Optional[int] = ..., sticky_sessions: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., routable: _Optional[bool] = ..., unroutable_reason: _Optional[str] = ..., added_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., consecutive_failures: _Optional[int] = ..., ejected_until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ejections: _Optional[int] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("replica_id", "weight_version", "tokens", "outcome", "started_at", "ended_at", "reason")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    weight_version: int
    tokens: int
    outcome: AttemptOutcome
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    reason: str
    def __init__(self, replica_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., tokens: _Optional[int] = ..., outcome: _Optional[_Union[AttemptOutcome, str]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class LoadBalancerStats(_message.Message):
    __slots__ = ("requests_total", "completed", "failed", "in_flight", "retries", "resumes", "regenerations", "truncated_dropped", "sticky_hits", "sticky_migrations", "no_replica_waits", "since", "outlier_ejections", "cancelled", "prefix_hits", "prefix_spills")
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    REGENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STICKY_HITS_FIELD_NUMBER: _ClassVar[int]
    STICKY_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NO_REPLICA_WAITS_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_EJECTIONS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SPILLS_FIELD_NUMBER: _ClassVar[int]
    requests_total: int
    completed: int
    failed: int
    in_flight: int
    retries: int
    resumes: int
    regenerations: int
    truncated_dropped: int
    sticky_hits: int
    sticky_migrations: int
    no_replica_waits: int
    since: _timestamp_pb2.Timestamp
    outlier_ejections: int
    cancelled: int
    prefix_hits: int
    prefix_spills: int
    def __init__(self, requests_total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., in_flight: _Optional[int] = ..., retries: _Optional[int] = ..., resumes: _Optional[int] = ..., regenerations: _Optional[int] = ..., truncated_dropped: _Optional[int] = ..., sticky_hits: _Optional[int] = ..., sticky_migrations: _Optional[int] = ..., no_replica_waits: _Optional[int] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., outlier_ejections: _Optional[int] = ..., cancelled: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., prefix_spills: _Optional[int] = ...) -> None: ...
