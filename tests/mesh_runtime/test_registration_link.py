"""The one registration loop (mesh_runtime.registration.keep_registered) that replica agents and balancers
hold their registration with: the controller's RetryInfo is obeyed exactly, the backoff grows while the
controller refuses and starts over after a session that had registered, and refusals are told apart from
outages in the log. Time is the test's own: asyncio.sleep is replaced by a recorder."""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
import pytest

from mesh_runtime.errors import status_proto
from mesh_runtime.failures import ResourceExhausted
from mesh_runtime.registration import LinkLost, keep_registered

pytestmark = pytest.mark.timeout(30)


class Stop(Exception):
    pass


def rpc_error(code: grpc.StatusCode, details: str = "x", retry_s: float | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if retry_s is not None:   # the status a server sends with a RetryInfo, as its trailing metadata
        status = status_proto(ResourceExhausted("fleet admission: come back later", retry_delay_s=retry_s))
        trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
        details = status.message
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


async def run(outcomes: list, monkeypatch) -> list[float]:
    """Waits keep_registered makes while sessions end with ``outcomes`` in turn (then it is stopped)."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)   # where the retry policy sleeps
    left = list(outcomes)

    async def session() -> None:
        if not left:
            raise Stop
        raise left.pop(0)

    with pytest.raises(Stop):
        await keep_registered(session, what="test", first_backoff_s=0.2, max_backoff_s=1.0, rng=random.Random(1))
    return waits


async def test_backoff_grows_to_its_bound_while_refused_and_starts_over_after_a_registered_session(monkeypatch):
    down = rpc_error(grpc.StatusCode.UNAVAILABLE)
    waits = await run([down, down, down, down, down, LinkLost("stream ended", registered=True), down], monkeypatch)
    bases = [0.2, 0.4, 0.8, 1.0, 1.0, 0.2, 0.4]
    assert len(waits) == len(bases)
    for wait, base in zip(waits, bases):
        assert 0.5 * base <= wait <= 1.5 * base


async def test_the_controllers_retry_info_is_obeyed_exactly(monkeypatch):
    waits = await run([LinkLost.from_rpc("RegisterNode failed", rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                          retry_s=3.25))], monkeypatch)
    assert waits == [3.25]


async def test_a_refusal_is_an_error_and_an_outage_a_warning(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="mesh_runtime.registration")
    await run([rpc_error(grpc.StatusCode.PERMISSION_DENIED, "certificate names lb/b, not lb/a"),
               rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")], monkeypatch)
    levels = [(r.levelno, "certificate" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.ERROR, True), (logging.WARNING, False)]


async def test_cancellation_ends_the_loop(monkeypatch):
    started = asyncio.Event()

    async def session() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(keep_registered(session, what="test"))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
