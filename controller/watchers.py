"""Fan-out of lifecycle events to WatchEvents streams without ever blocking the controller.

Each watcher has a bounded queue. Appending an event never waits: a watcher
whose queue is full is marked lagging and its queue dropped; its stream then
catches up from the event log's retained history, and if events were evicted
meanwhile it first receives a GAP event counting what it missed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from .core.events import EventLog, EventType, LifecycleEvent


_CATCH_UP = None
"""Queue marker: the watcher fell behind and must catch up from the log."""
_CLOSED = object()
"""Queue marker: the hub was closed (its controller stopped leading): the stream ends with the hub's error."""


class Watcher:
    def __init__(self, accept: Callable[[LifecycleEvent], bool], queue_size: int) -> None:
        self.accept = accept
        self.queue: asyncio.Queue[LifecycleEvent | None] = asyncio.Queue(queue_size)
        self.lagging = False
        self.last_sequence = 0


class EventHub:
    """Delivers every event appended to ``log`` to the watchers that want it."""

    def __init__(self, log: EventLog, queue_size: int) -> None:
        self.log = log
        self.queue_size = queue_size
        self._watchers: set[Watcher] = set()
        self.closed: Exception | None = None

    def close(self, error: Exception) -> None:
        """End every stream (now and later) with ``error``: its caller resumes elsewhere from its last event."""
        self.closed = error
        for watcher in self._watchers:
            while not watcher.queue.empty():
                watcher.queue.get_nowait()
            watcher.queue.put_nowait(_CLOSED)  # type: ignore[arg-type]

    def sizes(self) -> list[int]:
        """Events queued for each open WatchEvents stream now (each bounded by ``queue_size``)."""
        return [watcher.queue.qsize() for watcher in self._watchers]

    def publish(self, event: LifecycleEvent) -> None:
        for watcher in self._watchers:
            if watcher.lagging or not watcher.accept(event):
                continue
            try:
                watcher.queue.put_nowait(event)
            except asyncio.QueueFull:
                watcher.lagging = True
                while not watcher.queue.empty():
                    watcher.queue.get_nowait()
                watcher.queue.put_nowait(_CATCH_UP)  # wakes a stream waiting on the queue

    async def watch(self, from_sequence: int, accept: Callable[[LifecycleEvent], bool],
                    include_history: bool) -> AsyncIterator[LifecycleEvent]:
        """Events after ``from_sequence`` (history first when asked), then live ones, forever."""
        if self.closed is not None:
            raise self.closed
        watcher = Watcher(accept, self.queue_size)
        self._watchers.add(watcher)
        try:
            if from_sequence:
                watcher.last_sequence = from_sequence - 1
            else:
                watcher.last_sequence = 0 if include_history else self.log.last_sequence
            for event in self._catch_up(watcher):
                yield event
            while True:
                if watcher.lagging:
                    watcher.lagging = False
                    for event in self._catch_up(watcher):
                        yield event
                    continue
                live = await watcher.queue.get()
                if live is _CLOSED:
                    raise self.closed or RuntimeError("event hub closed")
                if live is _CATCH_UP or live.sequence <= watcher.last_sequence:
                    continue
                watcher.last_sequence = live.sequence
                yield live
        finally:
            self._watchers.discard(watcher)

    def _catch_up(self, watcher: Watcher) -> list[LifecycleEvent]:
        events, missed = self.log.since(watcher.last_sequence + 1)
        out: list[LifecycleEvent] = []
        if missed:
            out.append(LifecycleEvent(sequence=0, time=events[0].time if events else 0.0, type=EventType.GAP,
                                      reason=f"{missed} event(s) were no longer retained", missed_events=missed))
        out += [e for e in events if watcher.accept(e)]
        if events:
            watcher.last_sequence = events[-1].sequence
        while not watcher.queue.empty():  # already covered by the history just read
            watcher.queue.get_nowait()
        return out
