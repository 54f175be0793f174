"""When a failed call is worth another try: decided here, once, from the status and its details; and how it
is tried again: :class:`RetryPolicy`, a value every control-path loop is given, run by tenacity.

Three questions, three answers (and :func:`call_again`, a call repeated unchanged to the same server):

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

:func:`retry_after` reads the server's ``RetryInfo`` (None when it sent none); :func:`non_retryable` says
the server (or the layer below) already retried and spent its budget: a caller that retries it anyway
would retry one call in two layers, which the architecture forbids (the error carries
``non_retryable: true`` in its ``ErrorInfo`` metadata, Temporal's name for it).
The gRPC channels' own retry policy (:mod:`mesh_runtime.channels`, reads on
``UNAVAILABLE``) is the transport-level form of :func:`retry_same` for
idempotent reads; application retries are never stacked on those methods.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import tenacity

from .errors import error_info, retry_delay
from .failures import NON_RETRYABLE, RollmeshError

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


def non_retryable(err: BaseException) -> bool:
    """Whether the error says not to retry it (a layer below already spent its retries on it)."""
    if isinstance(err, RollmeshError):
        return err.non_retryable
    if isinstance(err, grpc.RpcError) and _code(err) is not None:
        info = error_info(err)
        return info is not None and info.metadata.get(NON_RETRYABLE) == "true"
    return False


def permanent(err: BaseException) -> bool:
    """Whether no retry, here or elsewhere, can fix ``err``; errors that are not RPC statuses are not."""
    return _code(err) in PERMANENT


@dataclass(frozen=True)
class RetryPolicy:
    """How a call is tried again, as a value (Temporal's ``RetryPolicy``); :meth:`run` and :meth:`run_sync`
    run it with tenacity.

    After the n-th failure in a row the wait is ``initial_s * multiplier ** (n - 1)``, at most ``max_s``,
    times a factor drawn uniformly from ``jitter`` (``(1, 1)``: none); a wait the error names replaces it
    (``wait_hint``, by default the server's ``RetryInfo``: :func:`retry_after`). Tries stop after
    ``max_attempts`` (None: no limit) or when the next one would start later than ``within_s`` after the
    first (None: no limit). The error decides before the policy does: a :func:`non_retryable` one is raised
    at once, and so is one the caller's ``retry_if`` refuses; one after which ``progressed`` says the call
    got somewhere (a stream that delivered, a session that registered) starts the backoff over."""

    initial_s: float = 0.2
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: tuple[float, float] = (1.0, 1.0)
    max_attempts: int | None = None
    within_s: float | None = None
    try_at_bound: bool = False
    """With ``within_s``: shorten the last wait so that a last try starts at the bound (a rendezvous waits for
    its peer the whole time), instead of stopping when the full wait would pass it."""
    rng: random.Random | None = field(default=None, compare=False, repr=False)
    """Where the jitter is drawn from (tests give a seeded one); None: the ``random`` module."""

    def __post_init__(self) -> None:
        low, high = self.jitter
        if self.initial_s < 0 or self.max_s < self.initial_s or self.multiplier < 1 or not 0 <= low <= high:
            raise ValueError(f"a retry policy needs 0 <= initial_s <= max_s, multiplier >= 1 and a jitter range "
                             f"0 <= low <= high: {self}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row (1 for the first)."""
        wait = min(self.max_s, self.initial_s * self.multiplier ** max(0, failures - 1))
        low, high = self.jitter
        return wait if low == high == 1.0 else wait * (self.rng or random).uniform(low, high)

    def _settings(self, retry_if: Callable[[BaseException], bool],
                  on_retry: Callable[[BaseException, float], None] | None,
                  wait_hint: Callable[[BaseException], float | None],
                  progressed: Callable[[BaseException], bool] | None) -> dict[str, Any]:
        failures = 0

        def error(state: tenacity.RetryCallState) -> BaseException | None:
            return state.outcome.exception() if state.outcome is not None else None

        def should(state: tenacity.RetryCallState) -> bool:
            err = error(state)
            # a cancellation, KeyboardInterrupt or SystemExit is never retried
            return isinstance(err, Exception) and not non_retryable(err) and retry_if(err)

        def wait(state: tenacity.RetryCallState) -> float:
            nonlocal failures
            err = error(state)
            failures = 1 if err is not None and progressed is not None and progressed(err) else failures + 1
            told = wait_hint(err) if err is not None else None
            if told is not None:
                return told
            wait = self.delay(failures)
            if self.try_at_bound and self.within_s is not None:
                wait = max(0.0, min(wait, self.within_s - (state.seconds_since_start or 0.0)))
            return wait

        def stop(state: tenacity.RetryCallState) -> bool:
            if self.max_attempts is not None and state.attempt_number >= self.max_attempts:
                return True
            started = state.seconds_since_start or 0.0
            if self.within_s is None:
                return False
            if self.try_at_bound and started >= self.within_s:
                return True
            return started + state.upcoming_sleep > self.within_s

        def before_sleep(state: tenacity.RetryCallState) -> None:
            err = error(state)
            if on_retry is not None and err is not None:
                on_retry(err, state.upcoming_sleep)

        return {"retry": should, "wait": wait, "stop": stop, "before_sleep": before_sleep, "reraise": True}

    async def run(self, call: Callable[[], Awaitable[T]], *, retry_if: Callable[[BaseException], bool],
                  on_retry: Callable[[BaseException, float], None] | None = None,
                  wait_hint: Callable[[BaseException], float | None] = lambda err: retry_after(err),
                  progressed: Callable[[BaseException], bool] | None = None) -> T:
        """``await call()`` until it returns or the error or the policy says stop (then the last error is
        raised); ``on_retry(error, wait)`` is told before each wait."""
        async def attempt() -> T:   # a coroutine function: tenacity awaits only those (not a lambda's result)
            return await call()

        result: T = await tenacity.AsyncRetrying(**self._settings(retry_if, on_retry, wait_hint, progressed))(attempt)
        return result

    def run_sync(self, call: Callable[[], T], *, retry_if: Callable[[BaseException], bool],
                 on_retry: Callable[[BaseException, float], None] | None = None,
                 wait_hint: Callable[[BaseException], float | None] = lambda err: retry_after(err),
                 progressed: Callable[[BaseException], bool] | None = None) -> T:
        """:meth:`run` for a blocking call (threads and start-up code), sleeping with ``time.sleep``."""
        return tenacity.Retrying(**self._settings(retry_if, on_retry, wait_hint, progressed))(call)


async def call_again(call: Callable[[float], Awaitable[T]], *, within_s: float, timeout_s: float | None = None,
                     idempotent: bool = True, backoff_s: float = 0.2, max_backoff_s: float = 2.0,
                     on_retry: Callable[[grpc.RpcError, float], None] | None = None) -> T:
    """``await call(timeout)``, and the same call again while :func:`retry_same` says it may succeed: after the
    wait the server asked for (:func:`retry_after`), else an exponential backoff from ``backoff_s`` up to
    ``max_backoff_s``, as long as the next try starts within ``within_s``; otherwise the failure is raised.
    Each try's timeout is ``timeout_s``, or (None) what remains of ``within_s``, at least half a second.
    ``on_retry(error, wait)`` is told before each wait. The retries of calls repeated unchanged (the step
    protocol's, whose repeats the controller answers from its record)."""
    deadline = time.monotonic() + within_s
    policy = RetryPolicy(initial_s=backoff_s, max_s=max_backoff_s, within_s=within_s)

    def again(err: BaseException) -> bool:
        return isinstance(err, grpc.aio.AioRpcError) and retry_same(err, idempotent=idempotent)

    def told(err: BaseException, wait: float) -> None:
        if on_retry is not None and isinstance(err, grpc.RpcError):
            on_retry(err, wait)

    return await policy.run(
        lambda: call(timeout_s if timeout_s is not None else max(0.5, deadline - time.monotonic())),
        retry_if=again, on_retry=told)
