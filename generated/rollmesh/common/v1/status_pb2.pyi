import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransportSecurity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_SECURITY_UNSPECIFIED: _ClassVar[TransportSecurity]
    TRANSPORT_SECURITY_MUTUAL_TLS: _ClassVar[TransportSecurity]
    TRANSPORT_SECURITY_PLAINTEXT_LOOPBACK: _ClassVar[TransportSecurity]
    TRANSPORT_SECURITY_PLAINTEXT_INSECURE: _ClassVar[TransportSecurity]
TRANSPORT_SECURITY_UNSPECIFIED: TransportSecurity
TRANSPORT_SECURITY_MUTUAL_TLS: TransportSecurity
TRANSPORT_SECURITY_PLAINTEXT_LOOPBACK: TransportSecurity
TRANSPORT_SECURITY_PLAINTEXT_INSECURE: TransportSecurity

class ServerStatus(_message.Message):
    __slots__ = ("server_name", "version", "node_id", "listen_address", "started_at", "uptime", "ready", "config", "capabilities", "transport_security", "identity")
    SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_SECURITY_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    server_name: str
    version: str
    node_id: str
    listen_address: str
    started_at: _timestamp_pb2.Timestamp
    uptime: _duration_pb2.Duration
    ready: bool
    config: _struct_pb2.Struct
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    transport_security: TransportSecurity
    identity: str
    def __init__(self, server_name: _Optional[str] = ..., version: _Optional[str] = ..., node_id: _Optional[str] = ..., listen_address: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., uptime: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., ready: _Optional[bool] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., capabilities: _Optional[_Iterable[str]] = ..., transport_security: _Optional[_Union[TransportSecurity, str]] = ..., identity: _Optional[str] = ...) -> None: ...
