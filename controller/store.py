"""The controller's durable state: an embedded SQLite file in its state directory.

State is kept as JSON documents by key (registry, scheduler, events, ...).
Writes are batched: callers mark what changed and :meth:`StateStore.flush`
writes it in one transaction (a background task flushes shortly after each
change, and shutdown flushes whatever is left), so a restart finds the
registry, the step protocol's position, policy state and event numbering.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SCHEMA = "CREATE TABLE IF NOT EXISTS documents (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


class StateStore:
    """JSON documents in ``<state_dir>/controller.sqlite``; ``state_dir=""`` keeps nothing."""

    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / "controller.sqlite" if state_dir else None
        self._sources: dict[str, Callable[[], Any]] = {}
        self._dirty: set[str] = set()
        self._wakeup = asyncio.Event()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                db.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        return sqlite3.connect(self.path, timeout=10)

    def load(self, key: str) -> Any | None:
        if self.path is None:
            return None
        with self._connect() as db:
            row = db.execute("SELECT value FROM documents WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def track(self, key: str, source: Callable[[], Any]) -> None:
        """Persist ``source()`` under ``key`` whenever :meth:`mark` names it."""
        self._sources[key] = source

    def mark(self, *keys: str) -> None:
        self._dirty.update(keys or self._sources)
        self._wakeup.set()

    def flush(self) -> None:
        if self.path is None or not self._dirty:
            self._dirty.clear()
            return
        keys, self._dirty = sorted(self._dirty), set()
        rows = [(key, json.dumps(self._sources[key]())) for key in keys]
        with self._connect() as db:
            db.executemany("INSERT OR REPLACE INTO documents (key, value) VALUES (?, ?)", rows)

    async def run(self, interval_s: float = 0.1) -> None:
        """Flush shortly after changes, until cancelled (then flush once more)."""
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                await asyncio.sleep(interval_s)  # batch the changes of one burst into one write
                self.flush()
        finally:
            self.flush()
