"""Test doubles for the driver: a controllable fake load balancer and a manual clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trainer_agent.driver import RolloutRequest, GenerationResult, Segment


class ManualClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


async def until(predicate: Callable[[], bool], *, spins: int = 10_000) -> None:
    """Yield to the event loop until ``predicate()`` holds (no wall-clock sleeping)."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


class FakeGenerate:
    """Each call blocks until the test completes or fails it by request id."""

    def __init__(self) -> None:
        self.calls: list[RolloutRequest] = []
        self.waiting: dict[str, asyncio.Future[GenerationResult]] = {}

    async def __call__(self, request: RolloutRequest) -> GenerationResult:
        self.calls.append(request)
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self.waiting[request.request_id] = fut
        try:
            return await fut
        finally:
            if self.waiting.get(request.request_id) is fut:
                del self.waiting[request.request_id]

    @property
    def in_flight(self) -> int:
        return len(self.waiting)

    def complete(self, request_id: str, tokens: list[int] | None = None, version: int = 0) -> None:
        tokens = tokens if tokens is not None else [7, 8]
        seg = Segment(token_ids=tokens, logprobs=[-0.5] * len(tokens), weight_version=version, replica_id="r0")
        self.waiting.pop(request_id).set_result(GenerationResult(segments=[seg], finish_reason="stop"))

    def complete_all(self) -> int:
        ids = list(self.waiting)
        for rid in ids:
            self.complete(rid)
        return len(ids)

    def fail(self, request_id: str, exc: BaseException) -> None:
        self.waiting.pop(request_id).set_exception(exc)
