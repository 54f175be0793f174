import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from rollmesh.common.v1 import status_pb2 as _status_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINING_STATE_UNSPECIFIED: _ClassVar[TrainingState]
    TRAINING_STATE_IDLE: _ClassVar[TrainingState]
    TRAINING_STATE_WAITING_FOR_SAMPLES: _ClassVar[TrainingState]
    TRAINING_STATE_TRAINING: _ClassVar[TrainingState]
    TRAINING_STATE_SYNCING_WEIGHTS: _ClassVar[TrainingState]
    TRAINING_STATE_FINISHED: _ClassVar[TrainingState]
    TRAINING_STATE_FAILED: _ClassVar[TrainingState]
TRAINING_STATE_UNSPECIFIED: TrainingState
TRAINING_STATE_IDLE: TrainingState
TRAINING_STATE_WAITING_FOR_SAMPLES: TrainingState
TRAINING_STATE_TRAINING: TrainingState
TRAINING_STATE_SYNCING_WEIGHTS: TrainingState
TRAINING_STATE_FINISHED: TrainingState
TRAINING_STATE_FAILED: TrainingState

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status", "rank", "world_size", "model", "training_backend", "weight_rendezvous_address")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAINING_BACKEND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.ServerStatus
    rank: int
    world_size: int
    model: str
    training_backend: str
    weight_rendezvous_address: str
    def __init__(self, status: _Optional[_Union[_status_pb2.ServerStatus, _Mapping]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., model: _Optional[str] = ..., training_backend: _Optional[str] = ..., weight_rendezvous_address: _Optional[str] = ...) -> None: ...

class GetTrainingProgressRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainingProgressResponse(_message.Message):
    __slots__ = ("global_step", "weight_version", "param_version", "samples_generated", "samples_consumed", "samples_dropped", "queue_size", "last_reward_mean", "state", "error_message", "final_step")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAM_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    weight_version: int
    param_version: int
    samples_generated: int
    samples_consumed: int
    samples_dropped: int
    queue_size: int
    last_reward_mean: float
    state: TrainingState
    error_message: str
    final_step: int
    def __init__(self, global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., param_version: _Optional[int] = ..., samples_generated: _Optional[int] = ..., samples_consumed: _Optional[int] = ..., samples_dropped: _Optional[int] = ..., queue_size: _Optional[int] = ..., last_reward_mean: _Optional[float] = ..., state: _Optional[_Union[TrainingState, str]] = ..., error_message: _Optional[str] = ..., final_step: _Optional[int] = ...) -> None: ...

class StopTrainingRequest(_message.Message):
    __slots__ = ("after_step",)
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    def __init__(self, after_step: _Optional[int] = ...) -> None: ...

class StopTrainingResponse(_message.Message):
    __slots__ = ("final_step",)
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    final_step: int
    def __init__(self, final_step: _Optional[int] = ...) -> None: ...

class OffloadTrainingStateRequest(_message.Message):
    __slots__ = ("include_optimizer",)
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    include_optimizer: bool
    def __init__(self, include_optimizer: _Optional[bool] = ...) -> None: ...

class OffloadTrainingStateResponse(_message.Message):
    __slots__ = ("bytes_moved", "duration")
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    bytes_moved: int
    duration: _duration_pb2.Duration
    def __init__(self, bytes_moved: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class OnloadTrainingStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OnloadTrainingStateResponse(_message.Message):
    __slots__ = ("bytes_moved", "duration")
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    bytes_moved: int
    duration: _duration_pb2.Duration
    def __init__(self, bytes_moved: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...
