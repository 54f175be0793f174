"""An asyncio event loop whose clock is virtual: it never sleeps, it jumps.

The controller core is async (locks, ``asyncio.wait_for`` deadlines,
``asyncio.gather`` over nodes). Running it on :class:`VirtualTimeLoop` makes
every ``asyncio.sleep``, timeout and timer use simulated seconds, so a port
call that "takes" 6 s costs no real time and concurrent calls overlap exactly
as they would on real hardware.

The loop cooperates with a :class:`World`: whenever asyncio has nothing ready
and would block until its next timer (or forever), it asks the world to run
its own events (sample completions, ...) up to that time. The world stops
early when one of its events resolves a future a coroutine awaits; the loop
then runs that coroutine at exactly that virtual time. Waiting forever with
no world events left is a deadlock and raises :class:`SimulationStalled`.
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Mapping
from typing import Any, Protocol


class SimulationStalled(RuntimeError):
    """Every coroutine waits and no simulated event will ever wake one."""


class World(Protocol):
    """What the loop needs from the simulated world."""

    now: float

    def run_until(self, limit: float) -> bool:
        """Process events with time <= ``limit``; True when one woke a coroutine (stop there)."""
        ...


class _VirtualSelector(selectors.BaseSelector):
    """Holds registrations (asyncio's self-pipe) and turns ``select`` into a clock jump."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._keys: dict[int, selectors.SelectorKey] = {}

    @staticmethod
    def _fd(fileobj: Any) -> int:
        return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, self._fd(fileobj), events, data)
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(self._fd(fileobj))

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[self._fd(fileobj)]

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self._loop._advance(timeout)
        return []

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` is ``world.now``; idle waits advance the world instead of sleeping."""

    def __init__(self, world: World) -> None:
        self._world = world
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._world.now

    def _advance(self, timeout: float | None) -> None:
        world = self._world
        limit = math.inf if timeout is None else world.now + max(0.0, timeout)
        if world.run_until(limit):
            return
        if math.isinf(limit):
            detail = getattr(world, "describe", None)
            raise SimulationStalled(f"simulation stalled at t={world.now:.3f} s: every task waits and no "
                                    f"simulated event is left to wake one"
                                    + (f" ({detail()})" if callable(detail) else ""))
        if limit > world.now:
            world.now = limit


def run_virtual(world: World, coro: Any) -> Any:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` over ``world``."""
    loop = VirtualTimeLoop(world)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
