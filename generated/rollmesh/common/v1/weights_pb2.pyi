import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProcessGroupBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_GROUP_BACKEND_UNSPECIFIED: _ClassVar[ProcessGroupBackend]
    PROCESS_GROUP_BACKEND_GLOO: _ClassVar[ProcessGroupBackend]
    PROCESS_GROUP_BACKEND_NCCL: _ClassVar[ProcessGroupBackend]
PROCESS_GROUP_BACKEND_UNSPECIFIED: ProcessGroupBackend
PROCESS_GROUP_BACKEND_GLOO: ProcessGroupBackend
PROCESS_GROUP_BACKEND_NCCL: ProcessGroupBackend

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "bucket_index", "offset_bytes", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bucket_index: int
    offset_bytes: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bucket_index: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("tensors", "bucket_size_bytes", "total_bytes", "checksum", "checksum_algorithm", "bucket_digests")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    bucket_size_bytes: int
    total_bytes: int
    checksum: str
    checksum_algorithm: str
    bucket_digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., bucket_size_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[str] = ..., checksum_algorithm: _Optional[str] = ..., bucket_digests: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightSyncMember(_message.Message):
    __slots__ = ("rank", "replica_id", "address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    replica_id: str
    address: str
    def __init__(self, rank: _Optional[int] = ..., replica_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class WeightSyncPlan(_message.Message):
    __slots__ = ("sync_id", "weight_version", "group_id", "rendezvous_host", "rendezvous_port", "world_size", "backend", "manifest", "timeout", "source", "members", "sync_key")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_KEY_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    weight_version: int
    group_id: str
    rendezvous_host: str
    rendezvous_port: int
    world_size: int
    backend: ProcessGroupBackend
    manifest: WeightManifest
    timeout: _duration_pb2.Duration
    source: str
    members: _containers.RepeatedCompositeFieldContainer[WeightSyncMember]
    sync_key: bytes
    def __init__(self, sync_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., group_id: _Optional[str] = ..., rendezvous_host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[_Union[ProcessGroupBackend, str]] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., source: _Optional[str] = ..., members: _Optional[_Iterable[_Union[WeightSyncMember, _Mapping]]] = ..., sync_key: _Optional[bytes] = ...) -> None: ...
