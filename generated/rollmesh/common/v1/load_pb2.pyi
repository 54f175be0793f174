import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rollmesh.common.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadReport(_message.Message):
    __slots__ = ("replica_id", "node_id", "state", "kind", "weight_version", "running_requests", "waiting_requests", "kv_cache_usage", "max_total_tokens", "used_tokens", "generation_tokens_per_second", "queue_time_p95", "time_to_first_token_p95", "inter_token_latency_mean", "inter_token_latency_p95", "reported_at", "prefix_cache_tokens", "prefix_cache_hit_rate")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_P95_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_P95_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCY_MEAN_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCY_P95_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    node_id: str
    state: _types_pb2.ReplicaState
    kind: _types_pb2.ReplicaKind
    weight_version: int
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    max_total_tokens: int
    used_tokens: int
    generation_tokens_per_second: float
    queue_time_p95: _duration_pb2.Duration
    time_to_first_token_p95: _duration_pb2.Duration
    inter_token_latency_mean: _duration_pb2.Duration
    inter_token_latency_p95: _duration_pb2.Duration
    reported_at: _timestamp_pb2.Timestamp
    prefix_cache_tokens: int
    prefix_cache_hit_rate: float
    def __init__(self, replica_id: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.ReplicaState, str]] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., weight_version: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., max_total_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., generation_tokens_per_second: _Optional[float] = ..., queue_time_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_token_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., inter_token_latency_mean: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., inter_token_latency_p95: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reported_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., prefix_cache_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ...) -> None: ...
