"""The one "wait until" helper of the tests: poll a condition owned by other processes, with a deadline.

Tests of a single process wait on events instead (an ``asyncio.Event`` or a
``Condition`` of the fake they drive); this helper is for state that lives in
other processes (servers started as processes), where polling is the only way.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_until(predicate: Callable[[], Any | Awaitable[Any]], timeout_s: float = 60.0, *,
                     every_s: float = 0.1, what: str = "condition") -> Any:
    """Call ``predicate`` (sync or async) until it returns something truthy; return that value.

    Raises ``AssertionError`` naming ``what`` when ``timeout_s`` passes first.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"{what} not met within {timeout_s:g} s")
        await asyncio.sleep(every_s)
