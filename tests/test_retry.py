"""The one retry classifier: which statuses are worth another try, on the same server or elsewhere."""

from __future__ import annotations

import grpc
import pytest

from mesh_runtime.errors import Aborted, ResourceExhausted, Unavailable, to_status
from mesh_runtime.retry import call_again, permanent, retry_after, retry_elsewhere, retry_same

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
