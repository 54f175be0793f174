"""The one retry classifier (which statuses are worth another try, on the same server or elsewhere) and the one
retry policy every control-path loop runs (RetryPolicy, on tenacity)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from mesh_runtime.errors import Aborted, ResourceExhausted, Unavailable, to_status
from mesh_runtime.retry import (RetryPolicy, call_again, non_retryable, permanent, retry_after, retry_elsewhere,
                                retry_same)

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, status: grpc.Status | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(*status.trailing_metadata) if status is not None else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing,
                                details=status.details if status is not None else "x")


def test_the_same_server_is_tried_again_only_when_that_can_help():
    assert retry_same(rpc_error(Code.UNAVAILABLE))
    assert not retry_same(rpc_error(Code.DEADLINE_EXCEEDED))           # it may have been done
    assert retry_same(rpc_error(Code.DEADLINE_EXCEEDED), idempotent=True)
    for code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.INTERNAL, Code.NOT_FOUND):
        assert not retry_same(rpc_error(code), idempotent=True), code
    assert not retry_same(ValueError("not an RPC"))


@pytest.mark.parametrize("error", [ResourceExhausted("busy", retry_delay_s=0.25), Aborted("again", retry_delay_s=0.25)])
def test_busy_or_aborted_is_tried_again_when_the_server_said_when(error):
    told = rpc_error(grpc.StatusCode[error.code], to_status(error))
    assert retry_after(told) == 0.25 and retry_same(told)
    untold = rpc_error(grpc.StatusCode[error.code])
    assert retry_after(untold) is None and not retry_same(untold)
    assert retry_after(rpc_error(Code.UNAVAILABLE, to_status(Unavailable("down")))) is None
    status = to_status(error)   # details that do not match the status's message: no RetryInfo believed
    mismatched = grpc.aio.AioRpcError(grpc.StatusCode[error.code], grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata),
                                      details="changed on the way")
    assert retry_after(mismatched) is None


def test_failover_and_permanent_statuses_do_not_overlap():
    for code in Code:
        err = rpc_error(code)
        assert not (retry_elsewhere(err) and permanent(err)), code
    assert retry_elsewhere(rpc_error(Code.FAILED_PRECONDITION))     # a replica that is not serving
    assert not retry_elsewhere(rpc_error(Code.DEADLINE_EXCEEDED))   # the caller's deadline is the same elsewhere
    assert permanent(rpc_error(Code.INVALID_ARGUMENT)) and not permanent(RuntimeError("x"))


async def test_a_call_is_repeated_unchanged_waiting_what_the_server_asks_until_the_deadline():
    tries: list[float] = []
    waits: list[float] = []
    answers = [rpc_error(Code.UNAVAILABLE),
               rpc_error(Code.RESOURCE_EXHAUSTED, to_status(ResourceExhausted("busy", retry_delay_s=0.05)))]

    async def call(timeout: float) -> str:
        tries.append(timeout)
        if answers:
            raise answers.pop(0)
        return "answer"

    got = await call_again(call, within_s=5.0, backoff_s=0.01, on_retry=lambda err, wait: waits.append(wait))
    assert got == "answer" and len(tries) == 3
    assert waits == [0.01, 0.05]                     # its backoff, then the wait the server asked for
    assert all(0.5 <= t <= 5.0 for t in tries)       # each try gets what remains of the deadline

    fixed: list[float] = []

    async def down(timeout: float) -> str:
        fixed.append(timeout)
        raise rpc_error(Code.UNAVAILABLE)

    with pytest.raises(grpc.aio.AioRpcError):        # given up once the next try would start past the deadline
        await call_again(down, within_s=0.2, timeout_s=7.0, backoff_s=0.05)
    assert 2 <= len(fixed) <= 4 and set(fixed) == {7.0}

    refused: list[float] = []

    async def wrong(timeout: float) -> str:
        refused.append(timeout)
        raise rpc_error(Code.INVALID_ARGUMENT)

    with pytest.raises(grpc.aio.AioRpcError):        # no repeat can fix it: raised at once
        await call_again(wrong, within_s=5.0)
    assert len(refused) == 1


def test_a_policys_waits_grow_to_their_bound_within_their_jitter():
    policy = RetryPolicy(initial_s=0.1, max_s=0.5)
    assert [policy.delay(n) for n in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = RetryPolicy(initial_s=1.0, max_s=1.0, jitter=(0.5, 1.5), rng=random.Random(3))
    draws = [jittered.delay(1) for _ in range(200)]
    assert 0.5 <= min(draws) < 0.6 and 1.4 < max(draws) <= 1.5
    for bad in ({"initial_s": 2.0, "max_s": 1.0}, {"multiplier": 0.5}, {"jitter": (1.0, 0.5)},
                {"max_attempts": 0}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The waits a policy sleeps (asyncio.sleep recorded instead of slept)."""
    slept: list[float] = []

    async def sleep(seconds: float, result=None):
        slept.append(seconds)
        return result

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return slept


def failing(*errors: BaseException, then: str = "done"):
    left = list(errors)
    calls: list[int] = []

    async def call() -> str:
        calls.append(1)
        if left:
            raise left.pop(0)
        return then
    call.calls = calls   # type: ignore[attr-defined]
    return call


async def test_a_policy_runs_until_success_or_its_attempts_are_spent(waits):
    policy = RetryPolicy(initial_s=0.1, max_s=1.0, max_attempts=3)
    call = failing(ConnectionError("a"), ConnectionError("b"))
    assert await policy.run(call, retry_if=lambda err: True) == "done" and waits == [0.1, 0.2]
    waits.clear()
    call = failing(*(ConnectionError(str(i)) for i in range(5)))
    with pytest.raises(ConnectionError, match="2"):              # the last error, as it was raised
        await policy.run(call, retry_if=lambda err: True)
    assert len(call.calls) == 3 and waits == [0.1, 0.2]


async def test_the_error_decides_before_the_policy(waits):
    policy = RetryPolicy(initial_s=0.1)
    spent = ResourceExhausted("budget spent", non_retryable=True)
    call = failing(spent)
    with pytest.raises(ResourceExhausted):
        await policy.run(call, retry_if=lambda err: True)
    assert len(call.calls) == 1 and non_retryable(spent) and not non_retryable(ResourceExhausted("busy"))
    wire = rpc_error(Code.RESOURCE_EXHAUSTED, to_status(spent))      # the flag crosses the wire
    assert non_retryable(wire) and not non_retryable(rpc_error(Code.UNAVAILABLE))
    call = failing(ValueError("refused by retry_if"))
    with pytest.raises(ValueError):
        await policy.run(call, retry_if=lambda err: isinstance(err, ConnectionError))
    call = failing(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):                       # a cancellation is never retried
        await policy.run(call, retry_if=lambda err: True)
    assert waits == []
    told = rpc_error(Code.UNAVAILABLE, to_status(Unavailable("later", retry_delay_s=0.75)))
    assert await policy.run(failing(told), retry_if=lambda err: True) == "done" and waits == [0.75]


async def test_progress_starts_the_backoff_over_and_within_bounds_the_whole(waits):
    class Delivered(ConnectionError):
        pass

    policy = RetryPolicy(initial_s=0.1, max_s=10.0)
    call = failing(ConnectionError(), ConnectionError(), Delivered(), ConnectionError())
    await policy.run(call, retry_if=lambda err: True, progressed=lambda err: isinstance(err, Delivered))
    assert waits == pytest.approx([0.1, 0.2, 0.1, 0.2])
    waits.clear()
    bounded = RetryPolicy(initial_s=1.0, max_s=1.0, within_s=0.5)   # the first wait would end past it
    with pytest.raises(ConnectionError):
        await bounded.run(failing(ConnectionError(), ConnectionError()), retry_if=lambda err: True)
    assert waits == []


def test_a_blocking_call_runs_the_same_policy():
    seen: list[tuple[str, float]] = []
    calls = iter([OSError("refused"), OSError("refused"), None])

    def connect() -> str:
        err = next(calls)
        if err is not None:
            raise err
        return "connected"

    policy = RetryPolicy(initial_s=0.001, max_s=0.002)
    assert policy.run_sync(connect, retry_if=lambda err: isinstance(err, OSError),
                           on_retry=lambda err, wait: seen.append((str(err), wait))) == "connected"
    assert seen == [("refused", 0.001), ("refused", 0.002)]


def test_a_policy_that_tries_at_its_bound_shortens_its_last_wait():
    tries: list[float] = []

    def connect() -> None:
        tries.append(time.monotonic())
        raise OSError("refused")

    policy = RetryPolicy(initial_s=5.0, max_s=5.0, within_s=0.1, try_at_bound=True)
    with pytest.raises(OSError):
        policy.run_sync(connect, retry_if=lambda err: True)
    assert len(tries) == 2 and 0.09 <= tries[1] - tries[0] < 1.0   # a last try at the bound, not after 5 s
    with pytest.raises(OSError):                                     # without: the 5 s wait would pass it
        RetryPolicy(initial_s=5.0, max_s=5.0, within_s=0.1).run_sync(connect, retry_if=lambda err: True)
    assert len(tries) == 3
