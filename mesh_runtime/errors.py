"""Domain errors and their one mapping onto canonical gRPC statuses.

Servicers raise these exceptions; :func:`abort_mapped` (run by every server's
:class:`~mesh_runtime.pipeline.ServerPipeline`) turns them
into a ``grpc.Status`` with a ``google.rpc.ErrorInfo`` detail (reason in
UPPER_SNAKE, domain ``rollmesh``), so no servicer builds a status by hand.
Anything else that escapes a handler becomes ``INTERNAL`` and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from .durations import set_seconds, to_seconds
from .reasons import Reason, known

log = logging.getLogger(__name__)

ERROR_DOMAIN = "rollmesh"


class RollmeshError(Exception):
    """Base of every error that crosses an RPC boundary.

    ``reason`` is one of the contract's :class:`~mesh_runtime.reasons.Reason` values
    (``ValueError`` for any other string); ``metadata`` carries structured context
    (for example the id of a conflicting operation).
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = Reason.INTERNAL

    def __init__(self, message: str, *, reason: str | None = None,
                 metadata: Mapping[str, object] | None = None, retry_delay_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = Reason(reason or self.default_reason)
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_delay_s = retry_delay_s
        """When set, the status also carries a ``google.rpc.RetryInfo``: retry after this long."""


class InvalidArgument(RollmeshError):
    """The request itself is malformed; retrying it unchanged cannot succeed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = Reason.INVALID_ARGUMENT


class NotFound(RollmeshError):
    """A named resource (replica, node, operation, request) does not exist."""

    code = grpc.StatusCode.NOT_FOUND
    default_reason = Reason.NOT_FOUND


class AlreadyExists(RollmeshError):
    """A resource with this id already exists or is in flight."""

    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = Reason.ALREADY_EXISTS


class FailedPrecondition(RollmeshError):
    """The system is not in a state that allows the call."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = Reason.FAILED_PRECONDITION


class Aborted(RollmeshError):
    """A conflicting concurrent operation prevents this one."""

    code = grpc.StatusCode.ABORTED
    default_reason = Reason.ABORTED


class Cancelled(RollmeshError):
    """The work was cancelled (a cancelled long-running operation's error)."""

    code = grpc.StatusCode.CANCELLED
    default_reason = Reason.CANCELLED


class OutOfRange(RollmeshError):
    """A position (sequence number, cycle index) is outside the valid range."""

    code = grpc.StatusCode.OUT_OF_RANGE
    default_reason = Reason.OUT_OF_RANGE


class ResourceExhausted(RollmeshError):
    """A quota or capacity (slots, retry budget, buffer) is used up."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = Reason.RESOURCE_EXHAUSTED


class Unavailable(RollmeshError):
    """Transiently unable to serve; the caller may retry (possibly elsewhere)."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = Reason.UNAVAILABLE


class DeadlineExceeded(RollmeshError):
    """The work did not finish within its deadline or timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = Reason.DEADLINE_EXCEEDED


class Unauthenticated(RollmeshError):
    """The call carries no valid credential."""

    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = Reason.UNAUTHENTICATED


class PermissionDenied(RollmeshError):
    """The credential is valid but does not allow this call."""

    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = Reason.PERMISSION_DENIED


class Unimplemented(RollmeshError):
    """The RPC belongs to a capability this server does not offer (yet)."""

    code = grpc.StatusCode.UNIMPLEMENTED
    default_reason = Reason.CAPABILITY_NOT_IMPLEMENTED


class Internal(RollmeshError):
    """An invariant broke inside the server."""

    code = grpc.StatusCode.INTERNAL
    default_reason = Reason.INTERNAL


MAX_MESSAGE = 2000
"""Longest error message sent; longer ones are cut (their bad values would otherwise travel whole)."""
MAX_METADATA_VALUE = 200
"""Longest ErrorInfo metadata value sent, so a status never outgrows gRPC's header limit."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def status_proto(err: RollmeshError) -> status_pb2.Status:
    """A domain error as a ``google.rpc.Status`` carrying an ``ErrorInfo`` (and ``RetryInfo`` when it says when
    to retry), sizes bounded: what a failed call carries, and a done long-running operation's ``error``."""
    metadata = {key[:MAX_METADATA_VALUE]: _cut(value, MAX_METADATA_VALUE) for key, value in err.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    if err.retry_delay_s is not None:
        retry = error_details_pb2.RetryInfo()
        set_seconds(retry.retry_delay, err.retry_delay_s)
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    return status_pb2.Status(code=err.code.value[0], message=_cut(err.message, MAX_MESSAGE), details=details)


def to_status(err: RollmeshError) -> grpc.Status:
    """Encode a domain error as a ``grpc.Status`` (:func:`status_proto`)."""
    return rpc_status.to_status(status_proto(err))


def error_info(rpc_error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """Read the ``ErrorInfo`` detail back from a failed call, if it has one."""
    status = rpc_status.from_call(rpc_error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def retry_delay(rpc_error: grpc.RpcError) -> float | None:
    """Seconds the server asked the caller to wait (its ``RetryInfo``), or None."""
    status = rpc_status.from_call(rpc_error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return to_seconds(info.retry_delay)
    return None


def relayed(rpc_error: grpc.RpcError) -> RollmeshError:
    """A failed call's status as a domain error, to pass on unchanged (code, message, reason, metadata and
    retry delay): what a server that forwards a call to another one raises."""
    info = error_info(rpc_error)
    code = rpc_error.code() if isinstance(rpc_error, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    if code is grpc.StatusCode.OK:
        code = grpc.StatusCode.UNKNOWN
    reason = info.reason if info is not None and known(info.reason) else None
    message = (rpc_error.details() or code.name) if isinstance(rpc_error, grpc.aio.AioRpcError) else str(rpc_error)
    err = RollmeshError(message, reason=reason or (code.name if known(code.name) else None),
                        metadata=dict(info.metadata) if info is not None else None,
                        retry_delay_s=retry_delay(rpc_error))
    err.code = code
    return err


def canonical(exc: BaseException) -> RollmeshError | None:
    """The mesh error for ``exc``: itself, or a domain error that names its canonical code.

    Packages that must not import grpc (the controller core) raise exceptions
    carrying ``code`` (a ``grpc.StatusCode`` name), ``reason`` and ``metadata``.
    """
    if isinstance(exc, RollmeshError):
        return exc
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in grpc.StatusCode.__members__ and code != "OK":
        reason = getattr(exc, "reason", None)
        err = RollmeshError(getattr(exc, "message", str(exc)),
                            reason=reason if reason and known(reason) else code if known(code) else None,
                            metadata=getattr(exc, "metadata", None))
        err.code = grpc.StatusCode[code]
        return err
    return None


async def abort_mapped(context: grpc.aio.ServicerContext, exc: BaseException, method: str):
    """End the call with the canonical status of ``exc`` (an unexpected one is logged and INTERNAL): the
    one mapping point, used by :class:`~mesh_runtime.pipeline.ServerPipeline`."""
    mapped = canonical(exc)
    if mapped is not None:
        await context.abort_with_status(to_status(mapped))
    log.exception("unhandled error in %s", method, exc_info=exc)
    await context.abort_with_status(
        to_status(Internal(f"internal error in {method}: {type(exc).__name__}: {exc}")))
