"""The controller's durable state, in the backend its ``store`` names (:mod:`controller.store_backends`):
an embedded SQLite file in its state directory (the default) or an etcd cluster.

State is kept as documents by key (scheduler, metrics, ...; each a message of
``proto/rollmesh/controller/state/v1``, checked by :mod:`controller.state_schema`), collections
of documents written one member at a time (the registry: one document per
node, with its replicas; a change rewrites that node's document only, so the
cost of a write does not grow with the fleet), plus an append-only table of
lifecycle events (each written once). The components hand over messages (their
``to_document()``), built on the event loop, so each is a consistent snapshot;
JSON encoding and the disk happen in the writer thread.
Writes are batched: callers mark what changed and :meth:`StateStore.flush`
writes it in one transaction (a background task flushes shortly after each
change, and shutdown flushes whatever is left), so a restart finds the
registry, the step protocol's position, policy state, event numbering, scale
operations and the autoscaler's history. What an RPC acknowledges is written
before the reply (:meth:`StateStore.commit`): the step protocol, node
registration and deregistration, weight syncs; scale operations flush at once
on every state change. Background changes (lease renewals) are batched.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from google.protobuf.message import Message

from mesh_runtime.retry import RetryPolicy
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

from .state_schema import EVENT, DocumentMismatch, DocumentSchema
from .store_backends import StoreBackend, StoreUnavailable, parse_store

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class StateStore:
    """Documents of ``schema`` in ``backend`` (None keeps nothing); a string is a state directory (SQLite in it)."""

    def __init__(self, backend: StoreBackend | str | None, keep_events: int = 10_000,
                 schema: DocumentSchema | None = None) -> None:
        self.backend = parse_store("", backend) if isinstance(backend, str) else backend
        self.schema = schema or DocumentSchema()
        """What each document is (:mod:`controller.state_schema`): the message of each key."""
        self.keep_events = keep_events
        self._written_since_prune = 0
        self._sources: dict[str, Callable[[], Message]] = {}
        self._collections: dict[str, Callable[[], Sequence[tuple[str, Message | None]]]] = {}
        self._dirty: set[str] = set()
        self._events: list[tuple[int, Message]] = []
        self._wakeup = asyncio.Event()
        self._generation = 0
        self._written: dict[str, int] = {}
        """Key -> generation of the snapshot last written: an older snapshot never overwrites a newer one
        (the background writer runs in a thread while :meth:`flush` may write synchronously)."""
        self._write_lock = threading.Lock()
        self._durable = 0
        """Generation of the newest batch on disk."""
        self._inflight: asyncio.Future | None = None
        """The batch being written (one at a time: a commit arriving meanwhile shares the next one)."""
        self._unwritten: dict[str, Message | None] = {}
        """Collection members of a batch the backend refused, for the next batch."""
        self.read_only = False
        """A standby's copy (or a deposed leader's): nothing is written, whatever is marked (the leader owns
        the store)."""
        self.on_write: Callable[[float, bool], None] | None = None
        """Called after each background or commit batch with its write time in seconds and whether it was
        stored (the controller's store metrics)."""
        self.on_events_stored: Callable[[int], None] | None = None
        """Called on the event loop with the newest event sequence once every event up to it is written (at
        once without a backend: there is nothing to wait for). The event streams deliver only those."""

    @property
    def description(self) -> str:
        return self.backend.description if self.backend is not None else "none (nothing kept across restarts)"

    def load(self, key: str, message: type[M]) -> M | None:
        """Document ``key`` (a ``message``, as the schema says), or None when there is none."""
        self._expect(key, message)
        if self.backend is None:
            return None
        value = self.backend.load(key)
        return self.schema.decode(key, value) if value is not None else None   # type: ignore[return-value]

    def load_collection(self, key: str, message: type[M]) -> list[M]:
        """Every member document of collection ``key`` (each a ``message``), in member order."""
        self._expect(key, message)
        if self.backend is None:
            return []
        return [self.schema.decode(key, value) for value in self.backend.load_prefix(f"{key}/")]  # type: ignore[misc]

    def _expect(self, key: str, message: type[Message]) -> None:
        if self.schema.message_of(key) is not message:
            raise DocumentMismatch(f"state document {key!r} is a {self.schema.message_of(key).__name__}, "
                                   f"not a {message.__name__}")

    def delete(self, key: str) -> None:
        """Drop document ``key`` now (a format migration)."""
        if self.backend is not None:
            with self._write_lock:
                self.backend.delete(key)

    def track_collection(self, key: str, changes: Callable[[], Sequence[tuple[str, Message | None]]]) -> None:
        """Persist collection ``key``: at each write, ``changes()`` gives (member, document or None to delete)
        for the members changed since its last call, and only those are written."""
        self.schema.message_of(key)   # a key without a schema fails here, not at the first write
        self._collections[key] = changes

    def track(self, key: str, source: Callable[[], Message]) -> None:
        """Persist ``source()`` (a fresh message of ``key``'s schema) under ``key`` whenever :meth:`mark` names it."""
        self.schema.message_of(key)
        self._sources[key] = source

    def mark(self, *keys: str) -> None:
        self._dirty.update(keys or self._sources)
        self._wakeup.set()

    def append_event(self, sequence: int, event: Message) -> None:
        """Queue one lifecycle event for the append-only events table."""
        if self.backend is None:
            if self.on_events_stored is not None:
                self.on_events_stored(sequence)   # kept nowhere: nothing to wait for
            return
        self._events.append((sequence, event))
        self._wakeup.set()

    def _stored(self, events: list[tuple[int, Message]]) -> None:
        if events and self.on_events_stored is not None:
            self.on_events_stored(max(sequence for sequence, _ in events))

    def load_events(self, limit: int) -> list[state_pb2.Event]:
        """The newest ``limit`` persisted events, oldest first."""
        if self.backend is None:
            return []
        return [self.schema.decode(EVENT, value) for value in self.backend.load_events(limit)]  # type: ignore[misc]

    def _collect(self) -> tuple[int, list[tuple[str, Message | None]], list[tuple[int, Message]]]:
        """Snapshot what changed (on the event loop, so it is consistent): the marked documents and the
        changed members of every collection."""
        keys, self._dirty = sorted(k for k in self._dirty if k in self._sources), set()
        events, self._events = self._events, []
        self._generation += 1
        members, self._unwritten = self._unwritten, {}   # a failed batch's members; newer changes win
        for key, changes in self._collections.items():
            for member, document in changes():
                members[f"{key}/{member}"] = document
        if self.backend is None:
            return self._generation, [], []
        # the documents are built here (each a snapshot), encoded in the writer thread
        return self._generation, [(key, self._sources[key]()) for key in keys] + list(members.items()), events

    def _requeue(self, documents: list[tuple[str, Message | None]], events: list[tuple[int, Message]]) -> None:
        """A batch that could not be written goes into the next one: tracked documents are marked again (the
        next batch takes a fresh snapshot), collection members and events are kept as they were."""
        for key, document in documents:
            if key in self._sources:
                self._dirty.add(key)
            else:
                self._unwritten.setdefault(key, document)
        self._events = events + self._events
        self._wakeup.set()

    def _write(self, generation: int, documents: list[tuple[str, Message | None]],
               events: list[tuple[int, Message]]) -> None:
        if not documents and not events:
            return
        if self.read_only:
            raise StoreUnavailable("this controller is a standby: it does not write the state store")
        with self._write_lock:
            documents = [(k, v) for k, v in documents if self._written.get(k, 0) < generation]
            upserts = [(k, self.schema.encode(k, v)) for k, v in documents if v is not None]
            deletes = [k for k, v in documents if v is None]
            rows = [(sequence, self.schema.encode(EVENT, event)) for sequence, event in events]
            assert self.backend is not None
            self.backend.write(upserts, deletes, rows)
            for key, _ in documents:
                self._written[key] = generation
        self._written_since_prune += len(events)
        if self._written_since_prune > self.keep_events:
            self.prune_events(self.keep_events)

    def flush(self) -> None:
        """Write everything pending now (shutdown, tests); nothing on a read-only copy."""
        if not self.read_only:
            generation, documents, events = self._collect()
            self._write(generation, documents, events)
            self._stored(events)

    def close(self) -> None:
        """Write everything pending, then release the backend's connections."""
        self.flush()
        if self.backend is not None:
            self.backend.close()

    async def commit(self, *keys: str) -> None:
        """Write what changed (``keys``, or every tracked document) and return once it is on disk.

        Durable before acknowledged: an RPC that changed state awaits this before
        it replies, so a kill -9 right after the reply finds the acknowledged
        state on restart. The write runs in a thread; the snapshot is taken on
        the event loop, so it is consistent. Group commit: one batch is written
        at a time, and every commit that arrives while it is written shares the
        next one (a registration storm makes a few large transactions, not one
        per node).
        """
        self.mark(*keys)
        await self._until_durable(self._generation + 1)

    async def settled(self, rounds: int = 8) -> None:
        """Return once every change marked so far is durable, so that what the caller reads right after (on
        the event loop, without awaiting) is a state no crash can undo — a scale operation's new state whose
        save is still in flight is shown once it is stored. Changes made while it waits are waited for too
        (at most ``rounds`` batches: under a constant stream of changes the read goes ahead). Nothing to wait
        for on a read-only copy."""
        for _ in range(rounds):
            if self.read_only:
                return
            pending = bool(self._dirty or self._events or self._unwritten)
            target = self._generation + (1 if pending else 0)
            if self._durable >= target:
                return
            await self._until_durable(target)

    async def _until_durable(self, generation: int) -> None:
        while self._durable < generation:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._batch())
            await asyncio.shield(self._inflight)

    async def _batch(self) -> None:
        try:
            generation, documents, events = self._collect()
            started = time.perf_counter()
            try:
                await asyncio.to_thread(self._write, generation, documents, events)
            except BaseException:
                self._requeue(documents, events)   # nothing of it is acknowledged; the next batch has it
                self._observe(started, ok=False)
                raise
            self._observe(started, ok=True)
            self._durable = max(self._durable, generation)
            self._stored(events)
        finally:
            self._inflight = None

    def _observe(self, started: float, *, ok: bool) -> None:
        if self.on_write is not None:
            self.on_write(time.perf_counter() - started, ok)

    def prune_events(self, keep: int) -> None:
        """Drop persisted events older than the newest ``keep``."""
        self._written_since_prune = 0
        if self.backend is not None:
            with self._write_lock:
                self.backend.prune_events(keep)

    async def run(self, interval_s: float = 0.1, retry_max_s: float = 5.0) -> None:
        """Flush shortly after changes, until cancelled (then flush once more). A backend that cannot be
        written (etcd without quorum) is retried with a growing pause (from twice ``interval_s`` up to
        ``retry_max_s``); nothing is dropped meanwhile, and changes made meanwhile join the next try."""
        policy = RetryPolicy(initial_s=2 * interval_s, max_s=max(retry_max_s, 2 * interval_s))

        def failed(err: BaseException, wait: float) -> None:
            # a document its message does not describe is a defect, not an outage: said louder
            log.log(logging.ERROR if isinstance(err, DocumentMismatch) else logging.WARNING,
                    "state store %s: write failed (%s); retrying in %.1f s", self.description, err, wait)

        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                await asyncio.sleep(interval_s)  # batch the changes of one burst into one write
                # the disk never blocks the loop; the writer must outlive a store outage
                await policy.run(lambda: self._until_durable(self._generation + 1), retry_if=lambda err: True,
                                 on_retry=failed)
        finally:
            self.flush()
