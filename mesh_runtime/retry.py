"""When a failed call is worth another try: decided here, once, from the status and its details.

Three questions, three answers (and :func:`call_again`, the one loop that repeats a call unchanged):

* :func:`retry_same` -- call the same server again with the same request? On
  ``UNAVAILABLE`` always (nothing was done, or the server said "not now");
  on ``DEADLINE_EXCEEDED`` only for an idempotent call (it may have been
  done); on ``RESOURCE_EXHAUSTED`` / ``ABORTED`` only when the server said
  when, with a ``google.rpc.RetryInfo``.
* :func:`retry_elsewhere` -- move the request to another server of the same
  kind (the balancer's failover between replicas)? On every status a
  different replica may not share: unavailable, busy, broken, or a replica
  that lost or does not know the request.
* :func:`permanent` -- is it a status no retry anywhere can fix (a malformed
  or refused request, missing rights, an unimplemented method)?

:func:`retry_after` reads the server's ``RetryInfo`` (None when it sent none).
The gRPC channels' own retry policy (:mod:`mesh_runtime.channels`, reads on
``UNAVAILABLE``) is the transport-level form of :func:`retry_same` for
idempotent reads; application retries are never stacked on those methods.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from .errors import retry_delay

Code = grpc.StatusCode
T = TypeVar("T")

PERMANENT = frozenset({Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.PERMISSION_DENIED, Code.UNAUTHENTICATED,
                       Code.UNIMPLEMENTED, Code.DATA_LOSS})
"""Statuses no retry can fix: the request or the caller's rights are wrong, or the method is not there."""

_ELSEWHERE = frozenset({Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.INTERNAL, Code.UNKNOWN, Code.NOT_FOUND,
                        Code.ALREADY_EXISTS, Code.CANCELLED, Code.FAILED_PRECONDITION})


def _code(err: BaseException) -> grpc.StatusCode | None:
    return err.code() if isinstance(err, grpc.RpcError) and hasattr(err, "code") else None


def retry_after(err: BaseException) -> float | None:
    """Seconds the server asked the caller to wait before the next try (its ``RetryInfo``), or None."""
    if not isinstance(err, grpc.RpcError) or _code(err) is None:
        return None
    try:
        return retry_delay(err)
    except ValueError:   # a status whose details disagree with its code or message: believe none of it
        return None


def retry_same(err: BaseException, *, idempotent: bool = False) -> bool:
    """Whether calling the same server again with the same request may succeed."""
    code = _code(err)
    if code is Code.UNAVAILABLE:
        return True
    if code is Code.DEADLINE_EXCEEDED:
        return idempotent
    if code in (Code.RESOURCE_EXHAUSTED, Code.ABORTED):
        return retry_after(err) is not None
    return False


def retry_elsewhere(err: BaseException) -> bool:
    """Whether another server of the same kind (another replica) may succeed where this one failed."""
    return _code(err) in _ELSEWHERE


def permanent(err: BaseException) -> bool:
    """Whether no retry, here or elsewhere, can fix ``err``; errors that are not RPC statuses are not."""
    return _code(err) in PERMANENT


async def call_again(call: Callable[[float], Awaitable[T]], *, within_s: float, timeout_s: float | None = None,
                     idempotent: bool = True, backoff_s: float = 0.2, max_backoff_s: float = 2.0,
                     on_retry: Callable[[grpc.RpcError, float], None] | None = None) -> T:
    """``await call(timeout)``, and the same call again while :func:`retry_same` says it may succeed: after the
    wait the server asked for (:func:`retry_after`), else an exponential backoff from ``backoff_s`` up to
    ``max_backoff_s``, as long as the next try starts within ``within_s``; otherwise the failure is raised.
    Each try's timeout is ``timeout_s``, or (None) what remains of ``within_s``, at least half a second.
    ``on_retry(error, wait)`` is told before each wait. The one retry loop of calls repeated unchanged (the
    step protocol's, whose repeats the controller answers from its record)."""
    deadline = time.monotonic() + within_s
    backoff = backoff_s
    while True:
        timeout = timeout_s if timeout_s is not None else max(0.5, deadline - time.monotonic())
        try:
            return await call(timeout)
        except grpc.aio.AioRpcError as err:
            told = retry_after(err)
            wait = told if told is not None else backoff
            if not retry_same(err, idempotent=idempotent) or time.monotonic() + wait > deadline:
                raise
            if on_retry is not None:
                on_retry(err, wait)
            await asyncio.sleep(wait)
            backoff = min(max_backoff_s, backoff * 2)
