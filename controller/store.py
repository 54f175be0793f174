"""The controller's durable state: an embedded SQLite file in its state directory.

State is kept as JSON documents by key (scheduler, metrics, ...), collections
of documents written one member at a time (the registry: one document per
node, with its replicas; a change rewrites that node's document only, so the
cost of a write does not grow with the fleet), plus an append-only table of
lifecycle events (each written once). JSON encoding and the disk happen in the
writer thread; the event loop only takes the snapshot of what changed.
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
import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SCHEMA = ("CREATE TABLE IF NOT EXISTS documents (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
           "CREATE TABLE IF NOT EXISTS events (sequence INTEGER PRIMARY KEY, value TEXT NOT NULL)")


class StateStore:
    """JSON documents in ``<state_dir>/controller.sqlite``; ``state_dir=""`` keeps nothing."""

    def __init__(self, state_dir: str, keep_events: int = 10_000) -> None:
        self.path = Path(state_dir) / "controller.sqlite" if state_dir else None
        self.keep_events = keep_events
        self._written_since_prune = 0
        self._sources: dict[str, Callable[[], Any]] = {}
        self._collections: dict[str, Callable[[], list[tuple[str, Any | None]]]] = {}
        self._dirty: set[str] = set()
        self._events: list[tuple[int, str]] = []
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
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                for statement in _SCHEMA:
                    db.execute(statement)

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        return sqlite3.connect(self.path, timeout=10)

    def load(self, key: str) -> Any | None:
        if self.path is None:
            return None
        with self._connect() as db:
            row = db.execute("SELECT value FROM documents WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def load_collection(self, key: str) -> list[Any]:
        """Every member document of collection ``key``, in member order."""
        if self.path is None:
            return []
        with self._connect() as db:
            rows = db.execute("SELECT value FROM documents WHERE key >= ? AND key < ? ORDER BY key",
                              (f"{key}/", f"{key}0")).fetchall()   # '0' sorts right after '/'
        return [json.loads(row[0]) for row in rows]

    def delete(self, key: str) -> None:
        """Drop document ``key`` now (a format migration)."""
        if self.path is not None:
            with self._write_lock, self._connect() as db:
                db.execute("DELETE FROM documents WHERE key = ?", (key,))

    def track_collection(self, key: str, changes: Callable[[], list[tuple[str, Any | None]]]) -> None:
        """Persist collection ``key``: at each write, ``changes()`` gives (member, document or None to delete)
        for the members changed since its last call, and only those are written."""
        self._collections[key] = changes

    def track(self, key: str, source: Callable[[], Any]) -> None:
        """Persist ``source()`` under ``key`` whenever :meth:`mark` names it."""
        self._sources[key] = source

    def mark(self, *keys: str) -> None:
        self._dirty.update(keys or self._sources)
        self._wakeup.set()

    def append_event(self, sequence: int, event: Any) -> None:
        """Queue one lifecycle event for the append-only events table."""
        if self.path is not None:
            self._events.append((sequence, json.dumps(event)))
            self._wakeup.set()

    def load_events(self, limit: int) -> list[Any]:
        """The newest ``limit`` persisted events, oldest first."""
        if self.path is None:
            return []
        with self._connect() as db:
            rows = db.execute("SELECT value FROM events ORDER BY sequence DESC LIMIT ?", (limit,)).fetchall()
        return [json.loads(row[0]) for row in reversed(rows)]

    def _collect(self) -> tuple[int, list[tuple[str, Any]], list[tuple[int, str]]]:
        """Snapshot what changed (on the event loop, so it is consistent): the marked documents and the
        changed members of every collection."""
        keys, self._dirty = sorted(k for k in self._dirty if k in self._sources), set()
        events, self._events = self._events, []
        self._generation += 1
        members = [(f"{key}/{member}", document) for key, changes in self._collections.items()
                   for member, document in changes()]
        if self.path is None:
            return self._generation, [], []
        # the tracked documents are encoded here (their sources may hand out live structures); the members
        # of collections are fresh objects, encoded in the writer thread
        return self._generation, [(key, json.dumps(self._sources[key]())) for key in keys] + members, events

    def _write(self, generation: int, documents: list[tuple[str, Any]], events: list[tuple[int, str]]) -> None:
        if not documents and not events:
            return
        with self._write_lock:
            documents = [(k, v) for k, v in documents if self._written.get(k, 0) < generation]
            upserts = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in documents if v is not None]
            deletes = [(k,) for k, v in documents if v is None]
            with self._connect() as db:
                db.executemany("INSERT OR REPLACE INTO documents (key, value) VALUES (?, ?)", upserts)
                db.executemany("DELETE FROM documents WHERE key = ?", deletes)
                db.executemany("INSERT OR REPLACE INTO events (sequence, value) VALUES (?, ?)", events)
            for key, _ in documents:
                self._written[key] = generation
        self._written_since_prune += len(events)
        if self._written_since_prune > self.keep_events:
            self.prune_events(self.keep_events)

    def flush(self) -> None:
        """Write everything pending now (shutdown, tests)."""
        self._write(*self._collect())

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

    async def _until_durable(self, generation: int) -> None:
        while self._durable < generation:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._batch())
            await asyncio.shield(self._inflight)

    async def _batch(self) -> None:
        try:
            generation, documents, events = self._collect()
            await asyncio.to_thread(self._write, generation, documents, events)
            self._durable = max(self._durable, generation)
        finally:
            self._inflight = None

    def prune_events(self, keep: int) -> None:
        """Drop persisted events older than the newest ``keep``."""
        self._written_since_prune = 0
        if self.path is not None:
            with self._connect() as db:
                db.execute("DELETE FROM events WHERE sequence <= (SELECT MAX(sequence) FROM events) - ?", (keep,))

    async def run(self, interval_s: float = 0.1) -> None:
        """Flush shortly after changes, until cancelled (then flush once more)."""
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                await asyncio.sleep(interval_s)  # batch the changes of one burst into one write
                await self._until_durable(self._generation + 1)  # the disk never blocks the loop
        finally:
            self.flush()
