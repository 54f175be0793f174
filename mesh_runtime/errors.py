"""Domain errors and their one mapping onto canonical gRPC statuses.

Servicers, the controller core and the engines raise :mod:`mesh_runtime.failures`' errors (re-exported
here); :func:`abort_mapped` (run by every server's :class:`~mesh_runtime.pipeline.ServerPipeline`) turns them
into a ``grpc.Status`` with a ``google.rpc.ErrorInfo`` detail (reason in
UPPER_SNAKE, domain ``rollmesh``), so no servicer builds a status by hand.
Anything else that escapes a handler becomes ``INTERNAL`` and is logged.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from .durations import set_seconds, to_seconds
from .failures import (  # noqa: F401 - the error classes, re-exported where servers import them
    RollmeshError,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    Aborted,
    Cancelled,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Unauthenticated,
    PermissionDenied,
    Unimplemented,
    Internal,
)
from .reasons import known

log = logging.getLogger(__name__)

ERROR_DOMAIN = "rollmesh"


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
    return status_pb2.Status(code=grpc.StatusCode[err.code].value[0], message=_cut(err.message, MAX_MESSAGE), details=details)


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
    err.code = code.name
    return err


def canonical(exc: BaseException) -> RollmeshError | None:
    """The mesh error ``exc`` is (every layer's errors derive from :class:`RollmeshError`), else None."""
    return exc if isinstance(exc, RollmeshError) else None


async def abort_mapped(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> NoReturn:
    """End the call with the canonical status of ``exc`` (an unexpected one is logged and INTERNAL): the
    one mapping point, used by :class:`~mesh_runtime.pipeline.ServerPipeline`."""
    mapped = canonical(exc)
    if mapped is not None:
        await context.abort_with_status(to_status(mapped))
    log.exception("unhandled error in %s", method, exc_info=exc)
    await context.abort_with_status(
        to_status(Internal(f"internal error in {method}: {type(exc).__name__}: {exc}")))
