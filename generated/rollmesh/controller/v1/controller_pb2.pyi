from google.longrunning import operations_pb2 as _operations_pb2
from rollmesh.common.v1 import status_pb2 as _status_pb2
from rollmesh.controller.v1 import autoscaler_pb2 as _autoscaler_pb2
from rollmesh.controller.v1 import observability_pb2 as _observability_pb2
from rollmesh.controller.v1 import registry_pb2 as _registry_pb2
from rollmesh.controller.v1 import scaling_pb2 as _scaling_pb2
from rollmesh.controller.v1 import scheduling_pb2 as _scheduling_pb2
from rollmesh.controller.v1 import weight_sync_pb2 as _weight_sync_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControllerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROLLER_ROLE_UNSPECIFIED: _ClassVar[ControllerRole]
    CONTROLLER_ROLE_LEADER: _ClassVar[ControllerRole]
    CONTROLLER_ROLE_STANDBY: _ClassVar[ControllerRole]
CONTROLLER_ROLE_UNSPECIFIED: ControllerRole
CONTROLLER_ROLE_LEADER: ControllerRole
CONTROLLER_ROLE_STANDBY: ControllerRole

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status", "hybrid_state", "node_count", "replica_count", "active_replica_count", "running_operation_id", "last_event_sequence", "peers", "state_store", "role", "leader_address", "leader_name")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HYBRID_STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    STATE_STORE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_NAME_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.ServerStatus
    hybrid_state: _scheduling_pb2.HybridState
    node_count: int
    replica_count: int
    active_replica_count: int
    running_operation_id: str
    last_event_sequence: int
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    state_store: str
    role: ControllerRole
    leader_address: str
    leader_name: str
    def __init__(self, status: _Optional[_Union[_status_pb2.ServerStatus, _Mapping]] = ..., hybrid_state: _Optional[_Union[_scheduling_pb2.HybridState, str]] = ..., node_count: _Optional[int] = ..., replica_count: _Optional[int] = ..., active_replica_count: _Optional[int] = ..., running_operation_id: _Optional[str] = ..., last_event_sequence: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., state_store: _Optional[str] = ..., role: _Optional[_Union[ControllerRole, str]] = ..., leader_address: _Optional[str] = ..., leader_name: _Optional[str] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("role", "address", "reachable", "error", "status")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    reachable: bool
    error: str
    status: _status_pb2.ServerStatus
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.ServerStatus, _Mapping]] = ...) -> None: ...
