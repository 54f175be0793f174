from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_KIND_UNSPECIFIED: _ClassVar[ReplicaKind]
    REPLICA_KIND_STANDALONE: _ClassVar[ReplicaKind]
    REPLICA_KIND_HYBRID: _ClassVar[ReplicaKind]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_LAUNCHING: _ClassVar[ReplicaState]
    REPLICA_STATE_LOADING: _ClassVar[ReplicaState]
    REPLICA_STATE_SYNCING: _ClassVar[ReplicaState]
    REPLICA_STATE_ACTIVE: _ClassVar[ReplicaState]
    REPLICA_STATE_PAUSED: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
    REPLICA_STATE_SLEEPING: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
    REPLICA_STATE_STOPPED: _ClassVar[ReplicaState]
    REPLICA_STATE_REMOVED: _ClassVar[ReplicaState]

class SleepLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLEEP_LEVEL_UNSPECIFIED: _ClassVar[SleepLevel]
    SLEEP_LEVEL_1: _ClassVar[SleepLevel]
    SLEEP_LEVEL_2: _ClassVar[SleepLevel]

class WakeTag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAKE_TAG_UNSPECIFIED: _ClassVar[WakeTag]
    WAKE_TAG_WEIGHTS: _ClassVar[WakeTag]
    WAKE_TAG_KV_CACHE: _ClassVar[WakeTag]

class EngineBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_BACKEND_UNSPECIFIED: _ClassVar[EngineBackend]
    ENGINE_BACKEND_TORCH: _ClassVar[EngineBackend]
    ENGINE_BACKEND_VLLM: _ClassVar[EngineBackend]
    ENGINE_BACKEND_SYNTHETIC: _ClassVar[EngineBackend]
    ENGINE_BACKEND_SGLANG: _ClassVar[EngineBackend]
REPLICA_KIND_UNSPECIFIED: ReplicaKind
REPLICA_KIND_STANDALONE: ReplicaKind
REPLICA_KIND_HYBRID: ReplicaKind
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_LAUNCHING: ReplicaState
REPLICA_STATE_LOADING: ReplicaState
REPLICA_STATE_SYNCING: ReplicaState
REPLICA_STATE_ACTIVE: ReplicaState
REPLICA_STATE_PAUSED: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState
REPLICA_STATE_SLEEPING: ReplicaState
REPLICA_STATE_FAILED: ReplicaState
REPLICA_STATE_STOPPED: ReplicaState
REPLICA_STATE_REMOVED: ReplicaState
SLEEP_LEVEL_UNSPECIFIED: SleepLevel
SLEEP_LEVEL_1: SleepLevel
SLEEP_LEVEL_2: SleepLevel
WAKE_TAG_UNSPECIFIED: WakeTag
WAKE_TAG_WEIGHTS: WakeTag
WAKE_TAG_KV_CACHE: WakeTag
ENGINE_BACKEND_UNSPECIFIED: EngineBackend
ENGINE_BACKEND_TORCH: EngineBackend
ENGINE_BACKEND_VLLM: EngineBackend
ENGINE_BACKEND_SYNTHETIC: EngineBackend
ENGINE_BACKEND_SGLANG: EngineBackend
