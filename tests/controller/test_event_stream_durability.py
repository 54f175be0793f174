"""A WatchEvents stream carries only stored events, so resuming it after a crash or a failover is exact.

An event shown before it was written could be lost by a kill -9; the controller
that comes next (restarted, or the standby that takes over) numbers its own
next event the same, and a watcher resuming after the lost one would skip it.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controller.config import ControllerConfig
from controller.core.events import EventType
from controller.mesh import Mesh
from controller.store_backends import StoreUnavailable
from mesh_runtime.config import load_config
from tests.controller.test_store import Refusing

pytestmark = pytest.mark.timeout(30)


def _mesh(tmp_path, backend: Refusing) -> Mesh:
    return Mesh(load_config(ControllerConfig, None, overrides={"state_dir": str(tmp_path / "state")}), None,
                backend=backend)


class Collector:
    """Reads one WatchEvents stream of ``mesh`` in the background."""

    def __init__(self, mesh: Mesh, from_sequence: int = 0) -> None:
        self.events: list = []
        self._arrived = asyncio.Condition()
        self._stream = mesh.hub.watch(from_sequence, lambda event: True, include_history=True)
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, mesh: Mesh, from_sequence: int = 0) -> Collector:
        """A collector whose stream is registered with the hub (so it is offered every event stored after)."""
        watchers = len(mesh.hub.sizes())
        collector = cls(mesh, from_sequence)
        async with asyncio.timeout(5):
            while len(mesh.hub.sizes()) == watchers:
                await asyncio.sleep(0)
        return collector

    async def _read(self) -> None:
        async for event in self._stream:
            async with self._arrived:
                self.events.append(event)
                self._arrived.notify_all()

    async def until(self, count: int) -> list:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: len(self.events) >= count)
        return self.events

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_an_event_is_streamed_once_stored_and_a_resumed_stream_misses_nothing(tmp_path):
    backend = Refusing(tmp_path / "s.sqlite")
    first = _mesh(tmp_path, backend)
    watcher = await Collector.open(first)
    first.emit(EventType.STEP_PHASE, reason="stored")
    await first.commit()
    seen = await watcher.until(1)
    assert [e.reason for e in seen] == ["stored"]

    backend.down = True   # the write of the next event fails: the kill -9 lands before it is on disk
    lost = first.emit(EventType.STEP_PHASE, reason="never stored")
    with pytest.raises(StoreUnavailable):
        await first.commit()
    assert first.hub.sizes() == [0]   # delivered synchronously if it were shown: the stream has not got it
    assert [e.reason for e in watcher.events] == ["stored"]
    await watcher.close()

    backend.down = False
    second = _mesh(tmp_path, backend)   # the controller that comes next reads what was stored
    taken_over = second.emit(EventType.LEADER_CHANGED, reason="took over")
    await second.commit()
    stored = [(e.sequence, e.reason) for e in second.events.since(1)[0]]
    assert stored[0] == (seen[-1].sequence, "stored") and lost.sequence == stored[1][0]   # its number, used again
    resumed = await Collector.open(second, from_sequence=seen[-1].sequence + 1)
    # every event the next controller has after the last one watched, from the reused number on, none skipped
    assert [(e.sequence, e.reason) for e in await resumed.until(len(stored) - 1)] == stored[1:]
    assert stored[-1] == (taken_over.sequence, "took over")
    await resumed.close()
    await second.close()


async def test_a_live_stream_gets_each_event_after_its_batch_is_written(tmp_path):
    backend = Refusing(tmp_path / "s.sqlite")
    mesh = _mesh(tmp_path, backend)
    watcher = await Collector.open(mesh)
    try:
        for i in range(3):
            mesh.emit(EventType.STEP_PHASE, reason=f"e{i}")
        assert mesh.hub.sizes() == [0]
        mesh.store.flush()   # shutdown's path writes too, and then the stream has them
        assert [e.reason for e in await watcher.until(3)] == ["e0", "e1", "e2"]
        assert [e.sequence for e in watcher.events] == [1, 2, 3]
    finally:
        await watcher.close()
        await mesh.close()
