"""Scale operations on the wire as ``google.longrunning.Operation``, and the ``google.longrunning.Operations``
service the controller serves for them: decode -> OperationBook / Scaler -> encode.

An operation is named ``operations/{operation_id}``; its metadata is a
``rollmesh.controller.v1.ScaleOperation`` (every field of its progress), and
once done it carries either a ``ScaleResult`` (ACTIVE, COMPLETED, NOOP) or a
``google.rpc.Status`` (FAILED: ABORTED with reason SCALE_OPERATION_FAILED;
CANCELLED: code CANCELLED, as AIP-151 asks). ListOperations' filter is the
small AIP-160 subset documented in ``scaling.proto``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc
from google.longrunning import operations_pb2, operations_pb2_grpc
from google.protobuf import empty_pb2

from mesh_runtime import pages
from mesh_runtime.durations import to_seconds
from mesh_runtime.errors import Aborted, Cancelled, InvalidArgument, status_proto
from mesh_runtime.reasons import Reason
from rollmesh.controller.v1 import scaling_pb2

from ..auth import require_scale_credential
from . import convert as convert_scaling
from .operations import OperationState, ScaleOperation

if TYPE_CHECKING:
    from ..config import ControllerConfig
    from .scaler import Scaler

OS = OperationState
NAME_PREFIX = "operations/"
COLLECTION = "operations"
SERVICE_NAME = operations_pb2.DESCRIPTOR.services_by_name["Operations"].full_name
SUCCEEDED = frozenset({OS.ACTIVE, OS.COMPLETED, OS.NOOP})
MAX_FILTER = 1000
"""Longest ListOperations filter accepted, in characters."""


def operation_name(operation_id: str) -> str:
    return f"{NAME_PREFIX}{operation_id}"


def operation_id(name: str) -> str:
    """The id in ``operations/{operation_id}``; INVALID_ARGUMENT for any other name."""
    if not name.startswith(NAME_PREFIX) or len(name) == len(NAME_PREFIX) or "/" in name[len(NAME_PREFIX):]:
        raise InvalidArgument(f"name {name[:64]!r} is not \"operations/{{operation_id}}\"",
                              reason=Reason.INVALID_OPERATION_NAME)
    return name[len(NAME_PREFIX):]


def result(op: ScaleOperation, would_remove: Iterable[str] = ()) -> scaling_pb2.ScaleResult:
    msg = scaling_pb2.ScaleResult(state=scaling_pb2.OperationState.Value(op.state.proto_name),
                                  replica_ids=list(would_remove) or op.replica_ids,
                                  failed_replica_ids=op.failed_replica_ids,
                                  error_message=op.error_message if op.failed_replica_ids else "")
    if op.weight_version is not None:
        msg.weight_version = op.weight_version
    return msg


def long_running(op: ScaleOperation, *, summary: str = "", would_remove: Iterable[str] = ()
                 ) -> operations_pb2.Operation:
    """``op`` as a ``google.longrunning.Operation``. A dry run's preview is done, unnamed (it was not stored)
    and its response says what would happen."""
    would_remove = list(would_remove)
    metadata = convert_scaling.operation(op)
    metadata.summary = summary
    metadata.would_remove_replica_ids.extend(would_remove)
    msg = operations_pb2.Operation(name="" if op.dry_run else operation_name(op.operation_id),
                                   done=op.finished or op.dry_run)
    msg.metadata.Pack(metadata)
    details = {"operation_id": op.operation_id}
    if op.state is OS.FAILED and not op.dry_run:
        msg.error.CopyFrom(status_proto(Aborted(op.error_message or "the scale operation failed",
                                                reason=Reason.SCALE_OPERATION_FAILED, metadata=details)))
    elif op.state is OS.CANCELLED and not op.dry_run:
        msg.error.CopyFrom(status_proto(Cancelled(op.error_message or "the scale operation was cancelled",
                                                  reason=Reason.SCALE_OPERATION_CANCELLED, metadata=details)))
    elif msg.done:
        msg.response.Pack(result(op, would_remove))
    return msg


# ------------------------------------------------------------------ filters
_TERM = re.compile(r'^\s*([a-z_]+)\s*=\s*(?:\(([^()]*)\)|"([^"]*)"|([^\s()"]+))\s*$')
_FIELDS = ("state", "type", "model_name")


def _value(field: str, text: str) -> object:
    text = text.strip().strip('"')
    if field == "model_name":
        return text
    enum, prefix = ((scaling_pb2.OperationState, "OPERATION_STATE_") if field == "state"
                    else (scaling_pb2.OperationType, "OPERATION_TYPE_"))
    name = text if text.startswith(prefix) else prefix + text
    if name not in enum.keys() or name.endswith("_UNSPECIFIED"):
        raise InvalidArgument(f"filter: unknown {field} {text[:40]!r}", reason=Reason.INVALID_FILTER)
    if field == "state":
        return convert_scaling.state_from_proto(scaling_pb2.OperationState.Value(name))
    return convert_scaling.type_from_proto(scaling_pb2.OperationType.Value(name))


def parse_filter(text: str) -> Callable[[ScaleOperation], bool]:
    """The predicate of a ListOperations filter: terms ``FIELD = VALUE`` or ``FIELD = (V OR V ...)`` joined by
    AND, FIELD one of state, type, model_name; empty matches everything."""
    if len(text) > MAX_FILTER:
        raise InvalidArgument(f"filter is {len(text)} characters; at most {MAX_FILTER}", reason=Reason.INVALID_FILTER)
    terms: list[tuple[str, set[object]]] = []
    for term in re.split(r"\s+AND\s+", text.strip()) if text.strip() else []:
        match = _TERM.match(term)
        if match is None:
            raise InvalidArgument(f"filter: cannot read {term.strip()[:60]!r}; write FIELD = VALUE or "
                                  "FIELD = (VALUE OR VALUE), joined by AND", reason=Reason.INVALID_FILTER)
        field, alternatives, quoted, bare = match.groups()
        if field not in _FIELDS:
            raise InvalidArgument(f"filter: unknown field {field[:40]!r}; one of {', '.join(_FIELDS)}",
                                  reason=Reason.INVALID_FILTER)
        raw = re.split(r"(?:^|\s)OR(?:\s|$)", alternatives.strip()) if alternatives is not None else [
            quoted if quoted is not None else bare]
        if not all(v.strip() for v in raw):
            raise InvalidArgument(f"filter: empty value in {term.strip()[:60]!r}", reason=Reason.INVALID_FILTER)
        terms.append((field, {_value(field, v) for v in raw}))

    def matches(op: ScaleOperation) -> bool:
        values = {"state": op.state, "type": op.type, "model_name": op.model_name}
        return all(values[field] in allowed for field, allowed in terms)
    return matches


def _newest_first(op: ScaleOperation) -> str:
    """A key that sorts operations newest first, ties by id: ListOperations' order and its page tokens."""
    return f"{2**62 - int(op.created_at * 1e6):020d}|{op.operation_id}"


class OperationsServicer(operations_pb2_grpc.OperationsServicer):
    """Implements ``google.longrunning.Operations`` over the controller's scale operations."""

    def __init__(self, scaler: Callable[[], Scaler], config: ControllerConfig) -> None:
        self._scaler = scaler
        self.config = config

    async def GetOperation(self, request: operations_pb2.GetOperationRequest,  # noqa: N802 - gRPC method names
                           context: grpc.aio.ServicerContext) -> operations_pb2.Operation:
        scaler = self._scaler()
        await scaler.store.settled()   # only what a crash cannot undo: a state whose save is still in
        return long_running(scaler.book.get(operation_id(request.name)))   # flight is shown once it is stored

    async def ListOperations(self, request: operations_pb2.ListOperationsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext) -> operations_pb2.ListOperationsResponse:
        if request.name not in ("", COLLECTION):
            raise InvalidArgument(f"name {request.name[:64]!r} is not \"operations\" (or empty)",
                                  reason=Reason.INVALID_OPERATION_NAME)
        keep = parse_filter(request.filter)
        scaler = self._scaler()
        await scaler.store.settled()
        ops = sorted((op for op in scaler.book.list() if keep(op)), key=_newest_first)
        chosen, token = pages.page(ops, key=_newest_first, page_size=request.page_size,
                                   page_token=request.page_token, filters=(request.filter.strip(),))
        return operations_pb2.ListOperationsResponse(
            operations=await pages.convert_all(chosen, long_running), next_page_token=token)

    async def WaitOperation(self, request: operations_pb2.WaitOperationRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> operations_pb2.Operation:
        op_id = operation_id(request.name)
        limit = to_seconds(request.timeout) if request.HasField("timeout") else None
        if limit is not None and limit <= 0:
            raise InvalidArgument(f"timeout must be positive, got {limit:g} s", reason=Reason.INVALID_TIMEOUT)
        remaining = context.time_remaining()
        if remaining is not None:   # answer with the latest state shortly before the call's deadline
            margin = min(0.5, remaining / 10)
            limit = remaining - margin if limit is None else min(limit, remaining - margin)
        op = await self._scaler().book.wait(op_id, None if limit is None else max(limit, 0.0))
        return long_running(op)

    async def CancelOperation(self, request: operations_pb2.CancelOperationRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> empty_pb2.Empty:
        require_scale_credential(context, self.config, "CancelOperation")
        op_id = operation_id(request.name)
        await self._scaler().cancel(op_id)
        return empty_pb2.Empty()

    async def DeleteOperation(self, request: operations_pb2.DeleteOperationRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> empty_pb2.Empty:
        require_scale_credential(context, self.config, "DeleteOperation")
        op_id = operation_id(request.name)
        await self._scaler().delete(op_id)
        return empty_pb2.Empty()
