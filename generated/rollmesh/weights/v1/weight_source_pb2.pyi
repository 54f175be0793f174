import datetime

from google.api import field_behavior_pb2 as _field_behavior_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from rollmesh.common.v1 import weights_pb2 as _weights_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareWeightSyncRequest(_message.Message):
    __slots__ = ("source_id", "weight_version", "bucket_size_bytes", "checksum_algorithm")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    weight_version: int
    bucket_size_bytes: int
    checksum_algorithm: str
    def __init__(self, source_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., bucket_size_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[str] = ...) -> None: ...

class PrepareWeightSyncResponse(_message.Message):
    __slots__ = ("weight_version", "manifest", "rendezvous_host", "rendezvous_port", "source")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    manifest: _weights_pb2.WeightManifest
    rendezvous_host: str
    rendezvous_port: int
    source: str
    def __init__(self, weight_version: _Optional[int] = ..., manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., rendezvous_host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class SendWeightsRequest(_message.Message):
    __slots__ = ("source_id", "plan")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    plan: _weights_pb2.WeightSyncPlan
    def __init__(self, source_id: _Optional[str] = ..., plan: _Optional[_Union[_weights_pb2.WeightSyncPlan, _Mapping]] = ...) -> None: ...

class SendWeightsResponse(_message.Message):
    __slots__ = ("bytes_sent", "duration", "checksum", "weight_version")
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    bytes_sent: int
    duration: _duration_pb2.Duration
    checksum: str
    weight_version: int
    def __init__(self, bytes_sent: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., checksum: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...
