"""Fan-out of lifecycle events to WatchEvents streams without ever blocking the controller.

A stream carries only events that are stored: the hub delivers an event once
the state store has written it (:meth:`EventHub.stored`), never before. So a
sequence number a watcher has seen is one that every later controller (this
one restarted, or a standby that takes over) also has, and a watcher that
resumes with ``from_sequence`` after a crash or a failover neither misses the
new leader's events nor holds one that the mesh forgot.

Each watcher has a bounded queue. Delivering an event never waits: a watcher
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
        self.stored_sequence = log.last_sequence
        """Newest event the store has written (its owner sets it when it loads the log from the store)."""

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

    def stored(self, sequence: int) -> None:
        """The store has written every event up to ``sequence``: deliver those not delivered yet."""
        if sequence <= self.stored_sequence:
            return
        first, self.stored_sequence = self.stored_sequence + 1, sequence
        if not self._watchers:
            return
        events, _ = self.log.since(first)
        for event in events:
            if event.sequence > sequence:
                break
            self._publish(event)

    def _publish(self, event: LifecycleEvent) -> None:
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
        """Events from ``from_sequence`` on (history first when asked; else those stored after the call), then
        live ones as they are stored, forever."""
        if self.closed is not None:
            raise self.closed
        watcher = Watcher(accept, self.queue_size)
        self._watchers.add(watcher)
        try:
            if from_sequence:
                watcher.last_sequence = from_sequence - 1
            else:
                watcher.last_sequence = 0 if include_history else self.stored_sequence
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
        events = [e for e in events if e.sequence <= self.stored_sequence]
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
