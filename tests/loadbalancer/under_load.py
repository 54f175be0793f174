"""Many generation requests through a balancer ring while something is killed, counted per request id."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import grpc

from tests.controller.scaling.helpers import generate


async def requests_through_a_kill(stub, kill: Callable[[], None], *, requests: int = 1000, concurrency: int = 100,
                                  max_tokens: int = 40) -> tuple[collections.Counter, collections.Counter]:
    """Send ``requests`` Generate calls (ids ``req-N``) through ``stub``, call ``kill()`` once 50 have completed,
    and retry each failed call with the same id as the rollouter does; ``(completions, attempts)`` per id."""
    completed: collections.Counter[str] = collections.Counter()
    attempts: collections.Counter[str] = collections.Counter()
    started = asyncio.Event()
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        request_id = f"req-{i}"
        async with semaphore:
            for _ in range(5):   # the rollouter's retry: same id, and the ring sends it to the next balancer
                attempts[request_id] += 1
                try:
                    final = await generate(stub, request_id, max_tokens)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    await asyncio.sleep(0.05)
                    continue
                assert final.usage.completion_tokens == max_tokens
                completed[request_id] += 1
                if len(completed) >= 50:
                    started.set()
                return
        raise AssertionError(f"{request_id} never completed")

    runs = asyncio.gather(*(one(i) for i in range(requests)))
    await started.wait()
    kill()   # mid-load
    await runs
    return completed, attempts
