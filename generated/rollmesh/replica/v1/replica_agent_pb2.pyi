import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.rpc import status_pb2 as _status_pb2
from rollmesh.common.v1 import generation_pb2 as _generation_pb2
from rollmesh.common.v1 import load_pb2 as _load_pb2
from rollmesh.common.v1 import status_pb2 as _status_pb2_1
from rollmesh.common.v1 import types_pb2 as _types_pb2
from rollmesh.common.v1 import weights_pb2 as _weights_pb2
from rollmesh.replica.v1 import replica_pb2 as _replica_pb2
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
    __slots__ = ("status", "node_id", "slots_total", "slots_free", "backend", "model", "replica_count")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2_1.ServerStatus
    node_id: str
    slots_total: int
    slots_free: int
    backend: _types_pb2.EngineBackend
    model: str
    replica_count: int
    def __init__(self, status: _Optional[_Union[_status_pb2_1.ServerStatus, _Mapping]] = ..., node_id: _Optional[str] = ..., slots_total: _Optional[int] = ..., slots_free: _Optional[int] = ..., backend: _Optional[_Union[_types_pb2.EngineBackend, str]] = ..., model: _Optional[str] = ..., replica_count: _Optional[int] = ...) -> None: ...

class LaunchReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "kind", "memory_fraction", "slots", "start_asleep", "weight_version", "request_id", "engine_url")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    START_ASLEEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    kind: _types_pb2.ReplicaKind
    memory_fraction: float
    slots: int
    start_asleep: bool
    weight_version: int
    request_id: str
    engine_url: str
    def __init__(self, replica_id: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.ReplicaKind, str]] = ..., memory_fraction: _Optional[float] = ..., slots: _Optional[int] = ..., start_asleep: _Optional[bool] = ..., weight_version: _Optional[int] = ..., request_id: _Optional[str] = ..., engine_url: _Optional[str] = ...) -> None: ...

class LaunchReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: _replica_pb2.Replica
    def __init__(self, replica: _Optional[_Union[_replica_pb2.Replica, _Mapping]] = ...) -> None: ...

class StopReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "grace", "force")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    grace: _duration_pb2.Duration
    force: bool
    def __init__(self, replica_id: _Optional[str] = ..., grace: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., force: _Optional[bool] = ...) -> None: ...

class StopReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: _replica_pb2.Replica
    def __init__(self, replica: _Optional[_Union[_replica_pb2.Replica, _Mapping]] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ("kinds", "states", "page_size", "page_token")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[_types_pb2.ReplicaKind]
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.ReplicaState]
    page_size: int
    page_token: str
    def __init__(self, kinds: _Optional[_Iterable[_Union[_types_pb2.ReplicaKind, str]]] = ..., states: _Optional[_Iterable[_Union[_types_pb2.ReplicaState, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas", "next_page_token")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_replica_pb2.Replica]
    next_page_token: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[_replica_pb2.Replica, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class GetReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: _replica_pb2.Replica
    def __init__(self, replica: _Optional[_Union[_replica_pb2.Replica, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("replica_id", "request_id", "prompt_token_ids", "sampling_params", "resume_segments", "stream_interval", "flush_interval", "session_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    resume_segments: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenSegment]
    stream_interval: int
    flush_interval: _duration_pb2.Duration
    session_id: str
    def __init__(self, replica_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., resume_segments: _Optional[_Iterable[_Union[_generation_pb2.TokenSegment, _Mapping]]] = ..., stream_interval: _Optional[int] = ..., flush_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "weight_version", "finish_reason", "usage", "segments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    finish_reason: _generation_pb2.FinishReason
    usage: _generation_pb2.Usage
    segments: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenSegment]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[_generation_pb2.TokenSegment, _Mapping]]] = ...) -> None: ...

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

class AbortRequestsRequest(_message.Message):
    __slots__ = ("replica_id", "requests", "all")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    requests: RequestIds
    all: bool
    def __init__(self, replica_id: _Optional[str] = ..., requests: _Optional[_Union[RequestIds, _Mapping]] = ..., all: _Optional[bool] = ...) -> None: ...

class RequestIds(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortRequestsResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("replica_ids", "mode", "timeout")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    mode: _replica_pb2.PauseMode
    timeout: _duration_pb2.Duration
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[_replica_pb2.PauseMode, str]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("replicas", "aborted_request_ids")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_replica_pb2.Replica]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_replica_pb2.Replica, _Mapping]]] = ..., aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ("replica_ids",)
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[_replica_pb2.Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[_replica_pb2.Replica, _Mapping]]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("replica_id", "level", "abort_in_flight")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    level: _types_pb2.SleepLevel
    abort_in_flight: bool
    def __init__(self, replica_id: _Optional[str] = ..., level: _Optional[_Union[_types_pb2.SleepLevel, str]] = ..., abort_in_flight: _Optional[bool] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("freed_bytes", "replica")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    replica: _replica_pb2.Replica
    def __init__(self, freed_bytes: _Optional[int] = ..., replica: _Optional[_Union[_replica_pb2.Replica, _Mapping]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("replica_id", "tags", "resume_generation")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    RESUME_GENERATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    tags: _containers.RepeatedScalarFieldContainer[_types_pb2.WakeTag]
    resume_generation: bool
    def __init__(self, replica_id: _Optional[str] = ..., tags: _Optional[_Iterable[_Union[_types_pb2.WakeTag, str]]] = ..., resume_generation: _Optional[bool] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: _replica_pb2.Replica
    def __init__(self, replica: _Optional[_Union[_replica_pb2.Replica, _Mapping]] = ...) -> None: ...

class ReceiveWeightsRequest(_message.Message):
    __slots__ = ("replica_ids", "plan", "abort_in_flight")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    plan: _weights_pb2.WeightSyncPlan
    abort_in_flight: bool
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ..., plan: _Optional[_Union[_weights_pb2.WeightSyncPlan, _Mapping]] = ..., abort_in_flight: _Optional[bool] = ...) -> None: ...

class ReplicaWeightsResult(_message.Message):
    __slots__ = ("replica_id", "weight_version", "checksum_ok", "bytes_received", "duration", "error_message")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_OK_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    weight_version: int
    checksum_ok: bool
    bytes_received: int
    duration: _duration_pb2.Duration
    error_message: str
    def __init__(self, replica_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., checksum_ok: _Optional[bool] = ..., bytes_received: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., error_message: _Optional[str] = ...) -> None: ...

class ReceiveWeightsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReplicaWeightsResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReplicaWeightsResult, _Mapping]]] = ...) -> None: ...

class GetLoadReportsRequest(_message.Message):
    __slots__ = ("replica_ids",)
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadReportsResponse(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[_load_pb2.LoadReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[_load_pb2.LoadReport, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("replica_id", "session_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    session_id: str
    def __init__(self, replica_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WatchPrefixCacheRequest(_message.Message):
    __slots__ = ("replica_ids",)
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchPrefixCacheResponse(_message.Message):
    __slots__ = ("replica_id", "block_tokens", "reset", "stored", "removed")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    block_tokens: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, replica_id: _Optional[str] = ..., block_tokens: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...
