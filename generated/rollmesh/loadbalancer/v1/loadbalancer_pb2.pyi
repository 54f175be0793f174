import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.rpc import status_pb2 as _status_pb2
from rollmesh.common.v1 import generation_pb2 as _generation_pb2
from rollmesh.common.v1 import status_pb2 as _status_pb2_1
from rollmesh.common.v1 import types_pb2 as _types_pb2
from rollmesh.loadbalancer.v1 import routing_pb2 as _routing_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status", "replica_count", "routable_replica_count", "in_flight")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2_1.ServerStatus
    replica_count: int
    routable_replica_count: int
    in_flight: int
    def __init__(self, status: _Optional[_Union[_status_pb2_1.ServerStatus, _Mapping]] = ..., replica_count: _Optional[int] = ..., routable_replica_count: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "session_id", "min_weight_version", "partial_rollout", "retry_budget", "stream_interval", "resume_segments", "flush_interval", "final_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESUME_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    session_id: str
    min_weight_version: int
    partial_rollout: bool
    retry_budget: int
    stream_interval: int
    resume_segments: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenSegment]
    flush_interval: _duration_pb2.Duration
    final_only: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., min_weight_version: _Optional[int] = ..., partial_rollout: _Optional[bool] = ..., retry_budget: _Optional[int] = ..., stream_interval: _Optional[int] = ..., resume_segments: _Optional[_Iterable[_Union[_generation_pb2.TokenSegment, _Mapping]]] = ..., flush_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., final_only: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "weight_version", "replica_id", "finish_reason", "usage", "segments", "attempts", "restarted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    replica_id: str
    finish_reason: _generation_pb2.FinishReason
    usage: _generation_pb2.Usage
    segments: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenSegment]
    attempts: _containers.RepeatedCompositeFieldContainer[_routing_pb2.Attempt]
    restarted: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[_generation_pb2.TokenSegment, _Mapping]]] = ..., attempts: _Optional[_Iterable[_Union[_routing_pb2.Attempt, _Mapping]]] = ..., restarted: _Optional[bool] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("actions",)
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[GenerateManyAction]
    def __init__(self, actions: _Optional[_Iterable[_Union[GenerateManyAction, _Mapping]]] = ...) -> None: ...

class GenerateManyAction(_message.Message):
    __slots__ = ("generate", "cancel_request_id", "trace_context", "timeout")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel_request_id: str
    trace_context: _containers.ScalarMap[str, str]
    timeout: _duration_pb2.Duration
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GenerateManyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GenerateManyItem, _Mapping]]] = ...) -> None: ...

class GenerateManyItem(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    error: _status_pb2.Status
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class AddReplicasRequest(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_routing_pb2.ReplicaEndpoint]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_routing_pb2.ReplicaEndpoint, _Mapping]]] = ...) -> None: ...

class AddReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_routing_pb2.RoutedReplica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_routing_pb2.RoutedReplica, _Mapping]]] = ...) -> None: ...

class RemoveReplicasRequest(_message.Message):
    __slots__ = ("replica_ids", "abort_in_flight")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    abort_in_flight: bool
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ..., abort_in_flight: _Optional[bool] = ...) -> None: ...

class RemoveReplicasResponse(_message.Message):
    __slots__ = ("removed_replica_ids", "dropped_sticky_sessions", "in_flight_request_ids")
    REMOVED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STICKY_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    removed_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    dropped_sticky_sessions: int
    in_flight_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed_replica_ids: _Optional[_Iterable[str]] = ..., dropped_sticky_sessions: _Optional[int] = ..., in_flight_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaUpdate(_message.Message):
    __slots__ = ("replica_id", "weight_version", "address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    weight_version: int
    address: str
    def __init__(self, replica_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class UpdateReplicasRequest(_message.Message):
    __slots__ = ("updates", "skip_unknown")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    SKIP_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[ReplicaUpdate]
    skip_unknown: bool
    def __init__(self, updates: _Optional[_Iterable[_Union[ReplicaUpdate, _Mapping]]] = ..., skip_unknown: _Optional[bool] = ...) -> None: ...

class UpdateReplicasResponse(_message.Message):
    __slots__ = ("replicas", "skipped_replica_ids")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_routing_pb2.RoutedReplica]
    skipped_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_routing_pb2.RoutedReplica, _Mapping]]] = ..., skipped_replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("kinds", "routable_only", "page_size", "page_token")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_ONLY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[_types_pb2.ReplicaKind]
    routable_only: bool
    page_size: int
    page_token: str
    def __init__(self, kinds: _Optional[_Iterable[_Union[_types_pb2.ReplicaKind, str]]] = ..., routable_only: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "next_page_token")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_routing_pb2.RoutedReplica]
    next_page_token: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[_routing_pb2.RoutedReplica, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ClearStickySessionsRequest(_message.Message):
    __slots__ = ("replica_ids",)
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearStickySessionsResponse(_message.Message):
    __slots__ = ("cleared_sessions",)
    CLEARED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    cleared_sessions: int
    def __init__(self, cleared_sessions: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("max_moves", "request_id")
    MAX_MOVES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    max_moves: int
    request_id: str
    def __init__(self, max_moves: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReplicaInFlight(_message.Message):
    __slots__ = ("replica_id", "in_flight_before", "in_flight_after")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_AFTER_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    in_flight_before: int
    in_flight_after: int
    def __init__(self, replica_id: _Optional[str] = ..., in_flight_before: _Optional[int] = ..., in_flight_after: _Optional[int] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("moved_request_ids", "replicas")
    MOVED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    moved_request_ids: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInFlight]
    def __init__(self, moved_request_ids: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInFlight, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _routing_pb2.LoadBalancerStats
    def __init__(self, stats: _Optional[_Union[_routing_pb2.LoadBalancerStats, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("replica_id", "released")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    released: bool
    def __init__(self, replica_id: _Optional[str] = ..., released: _Optional[bool] = ...) -> None: ...
