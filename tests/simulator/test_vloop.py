"""The virtual-time event loop: sleeps, timeouts and concurrency cost no real time; deadlocks are reported."""

from __future__ import annotations

import asyncio
import time

import pytest

from simulator.vloop import SimulationStalled, run_virtual

pytestmark = pytest.mark.timeout(30)


class EventWorld:
    """A world with scripted events at fixed times; each resolves a future."""

    def __init__(self, times):
        self.now = 0.0
        self.pending = sorted(times)
        self.futures = {}
        self.describe = lambda: "scripted world"

    def run_until(self, limit):
        if self.pending and self.pending[0] <= limit:
            t = self.pending.pop(0)
            self.now = t
            future = self.futures.pop(t, None)
            if future is not None and not future.done():
                future.set_result(t)
                return True
        return False

    def at(self, t):
        future = asyncio.get_running_loop().create_future()
        self.futures[t] = future
        return future


def test_sleeps_overlap_and_timeouts_fire_on_the_virtual_clock():
    world = EventWorld([])

    async def main():
        loop = asyncio.get_running_loop()

        async def nap(d):
            await asyncio.sleep(d)
            return loop.time()

        ends = await asyncio.gather(nap(5.0), nap(3.0), nap(7.5))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(1000.0), 30.0)
        return ends, loop.time()

    started = time.perf_counter()
    ends, now = run_virtual(world, main())
    assert ends == [5.0, 3.0, 7.5] and now == pytest.approx(37.5)
    assert time.perf_counter() - started < 5.0   # a week of virtual sleeping would otherwise take a week


def test_world_events_wake_coroutines_at_their_time_between_timers():
    world = EventWorld([4.0, 9.0])

    async def main():
        loop = asyncio.get_running_loop()
        first = world.at(4.0)
        timer = asyncio.ensure_future(asyncio.sleep(6.0))
        assert await first == 4.0 and loop.time() == 4.0
        await timer
        assert loop.time() == 6.0
        return await world.at(9.0), loop.time()

    assert run_virtual(world, main()) == (9.0, 9.0)


def test_waiting_forever_raises_simulation_stalled():
    world = EventWorld([])

    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled, match="stalled at t=0.000 s.*scripted world"):
        run_virtual(world, main())
