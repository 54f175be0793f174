"""Where the controller's state lives: an embedded SQLite file (the default) or an etcd cluster.

:class:`~controller.store.StateStore` decides *what* is written and *when*
(tracked documents, collections, events, group commit, durable before
acknowledged); a backend only stores strings by key, in batches:

- :class:`SqliteBackend` (``store: sqlite:///PATH``, or ``state_dir``): one
  file, one transaction per batch. One controller.
- :class:`EtcdBackend` (``store: etcd://HOST:PORT[,HOST:PORT...]/PREFIX``):
  documents under ``PREFIX/doc/<key>``, events under ``PREFIX/ev/<sequence>``,
  through etcd's v3 JSON gateway with the ``etcd3gw`` client. A batch is one
  etcd transaction (several when it exceeds etcd's default limits of 128
  operations or ~1 MiB per request), acknowledged by etcd once a quorum of
  members has it: state survives the loss of the controller's machine and of
  any minority of etcd members. Calls go to one member and move to the next
  one listed when it cannot be reached. With ``store_tls`` they use https, the
  members' CA and a client certificate; the environment's proxy and CA
  settings never apply to them.

Both are synchronous and thread-safe: the store calls them from its writer
thread.
"""

from __future__ import annotations

import base64
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from mesh_runtime.config import ConfigError
from mesh_runtime.errors import Unavailable
from mesh_runtime.net import parse_host_port
from mesh_runtime.reasons import Reason

log = logging.getLogger(__name__)

_SCHEMA = ("CREATE TABLE IF NOT EXISTS documents (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
           "CREATE TABLE IF NOT EXISTS events (sequence INTEGER PRIMARY KEY, value TEXT NOT NULL)")
MAX_TXN_OPS = 128
"""Operations per etcd transaction: etcd's default ``--max-txn-ops``."""
MAX_TXN_BYTES = 1 << 20
"""Bytes of values per etcd transaction, below etcd's default 1.5 MiB ``--max-request-bytes``."""


class StoreBackend(Protocol):
    """String documents by key and an ordered event log, written in batches."""

    description: str

    def load(self, key: str) -> str | None: ...

    def load_prefix(self, prefix: str) -> list[str]:
        """Values of every key starting with ``prefix``, in key order."""
        ...

    def delete(self, key: str) -> None: ...

    def write(self, upserts: Sequence[tuple[str, str]], deletes: Sequence[str],
              events: Sequence[tuple[int, str]]) -> None:
        """Store one batch; returns once it is durable."""
        ...

    def load_events(self, limit: int) -> list[str]:
        """The newest ``limit`` events, oldest first."""
        ...

    def prune_events(self, keep: int) -> None:
        """Drop events older than the newest ``keep``."""
        ...

    def close(self) -> None: ...


class SqliteBackend:
    """Documents and events in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"sqlite://{path.resolve()}"
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            for statement in _SCHEMA:
                db.execute(statement)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10)

    def load(self, key: str) -> str | None:
        with self._connect() as db:
            row = db.execute("SELECT value FROM documents WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def load_prefix(self, prefix: str) -> list[str]:
        with self._connect() as db:
            rows = db.execute("SELECT value FROM documents WHERE key >= ? AND key < ? ORDER BY key",
                              (prefix, _after(prefix))).fetchall()
        return [row[0] for row in rows]

    def delete(self, key: str) -> None:
        with self._lock, self._connect() as db:
            db.execute("DELETE FROM documents WHERE key = ?", (key,))

    def write(self, upserts: Sequence[tuple[str, str]], deletes: Sequence[str],
              events: Sequence[tuple[int, str]]) -> None:
        with self._lock, self._connect() as db:
            db.executemany("INSERT OR REPLACE INTO documents (key, value) VALUES (?, ?)", upserts)
            db.executemany("DELETE FROM documents WHERE key = ?", [(k,) for k in deletes])
            db.executemany("INSERT OR REPLACE INTO events (sequence, value) VALUES (?, ?)", events)

    def load_events(self, limit: int) -> list[str]:
        with self._connect() as db:
            rows = db.execute("SELECT value FROM events ORDER BY sequence DESC LIMIT ?", (limit,)).fetchall()
        return [row[0] for row in reversed(rows)]

    def prune_events(self, keep: int) -> None:
        with self._lock, self._connect() as db:
            db.execute("DELETE FROM events WHERE sequence <= (SELECT MAX(sequence) FROM events) - ?", (keep,))

    def close(self) -> None:
        pass


def _after(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix`` (a range's end)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def b64(text: str) -> str:
    """``text`` as the gateway's base64 of its bytes (keys and values)."""
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _session(tls: Any) -> Any:
    """An HTTP session for the store that ignores the environment: neither *_PROXY nor REQUESTS_CA_BUNDLE
    may send the mesh's state elsewhere or trust another CA for it."""
    import requests  # noqa: PLC0415 - etcd3gw's HTTP client

    session = requests.Session()
    session.trust_env = False
    if tls is not None:
        session.verify = tls.ca
        if tls.cert:
            session.cert = (tls.cert, tls.key)
    return session


class StoreUnavailable(Unavailable):
    """No etcd member listed answered (down, or without quorum): UNAVAILABLE, retry shortly."""

    default_reason = Reason.STORE_UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_delay_s=1.0)


class EtcdMembers:
    """Clients of every member of one etcd cluster: a call goes to the current member and moves on to the next
    one listed when it cannot be reached."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], clients: list[Any], errors: Any) -> None:
        self._endpoints = list(endpoints)
        self._clients = clients
        self._errors = errors
        self._current = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to the gateway's ``path`` on the first member that answers; StoreUnavailable if none."""
        failures = []
        for _ in range(len(self._clients)):
            index = self._current
            client = self._clients[index]
            try:
                return client.post(client.get_url(path), json=body)
            except (self._errors.ConnectionFailedError, self._errors.ConnectionTimeoutError,
                    self._errors.InternalServerError) as err:
                host, port = self._endpoints[index]
                failures.append(f"{host}:{port}: {type(err).__name__}")
                self._current = (index + 1) % len(self._clients)
        raise StoreUnavailable(f"etcd {path}: no member answered ({'; '.join(failures)})")

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


class EtcdBackend:
    """Documents and events in etcd under ``prefix``, through the v3 JSON gateway (``etcd3gw``)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: str, *, timeout_s: float = 5.0,
                 tls: Any = None) -> None:
        """``tls``: a :class:`~controller.config.StoreTlsConfig` (https, the members' CA, a client certificate)."""
        import etcd3gw  # noqa: PLC0415 - only a controller configured for etcd needs it

        self.endpoints = list(endpoints)
        self.prefix = prefix.rstrip("/")
        self.description = ("etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + self.prefix
                            + (" (TLS)" if tls is not None else ""))
        self.errors = etcd3gw.exceptions
        self._make_client = lambda host, port: etcd3gw.Etcd3Client(
            host=host, port=port, timeout=timeout_s, api_path="/v3/", session=_session(tls),
            protocol="https" if tls is not None else "http")
        self._members = self.new_members()
        self._lock = threading.Lock()
        self.fence: tuple[str, int] | None = None
        """(owner key, its create revision) once this controller owns the store (:mod:`controller.store_owner`):
        every write then only lands while that key is still the one it created."""
        self.on_fenced: Callable[[str], None] | None = None
        """Told when a write was refused by the fence (the store is lost)."""

    def new_members(self) -> EtcdMembers:
        """Fresh clients of every member (their own HTTP sessions, for another thread)."""
        return EtcdMembers(self.endpoints, [self._make_client(h, p) for h, p in self.endpoints], self.errors)

    def _range(self, start: str, end: str, *, descend: bool = False, limit: int = 0) -> list[str]:
        payload: dict[str, Any] = {"key": b64(start), "range_end": b64(end), "sort_target": "KEY",
                                   "sort_order": "DESCEND" if descend else "ASCEND"}
        if limit:
            payload["limit"] = limit
        reply = self._members.post("/kv/range", payload)
        return [_unb64(kv.get("value", "")) for kv in reply.get("kvs", [])]

    def _doc(self, key: str) -> str:
        return f"{self.prefix}/doc/{key}"

    def _event(self, sequence: int) -> str:
        return f"{self.prefix}/ev/{sequence:020d}"

    def load(self, key: str) -> str | None:
        found = self._range(self._doc(key), self._doc(key) + "\0")
        return found[0] if found else None

    def load_prefix(self, prefix: str) -> list[str]:
        start = self._doc(prefix)
        return self._range(start, _after(start))

    def delete(self, key: str) -> None:
        with self._lock:
            self._txn([{"request_delete_range": {"key": b64(self._doc(key))}}])

    def _txn(self, operations: list[dict[str, Any]]) -> None:
        body: dict[str, Any] = {"success": operations}
        if self.fence is not None:
            key, revision = self.fence
            body["compare"] = [{"key": b64(key), "target": "CREATE", "result": "EQUAL",
                                "create_revision": revision}]
        reply = self._members.post("/kv/txn", body)
        if self.fence is not None and not reply.get("succeeded", False):
            if self.on_fenced is not None:
                self.on_fenced("a write was fenced off")
            raise StoreFenced(f"this controller no longer owns the state store ({self.fence[0]} is not the key it "
                              "created: its lease ran out and another controller took over); nothing was written")

    def write(self, upserts: Sequence[tuple[str, str]], deletes: Sequence[str],
              events: Sequence[tuple[int, str]]) -> None:
        operations = [({"request_put": {"key": b64(self._doc(k)), "value": b64(v)}}, len(v)) for k, v in upserts]
        operations += [({"request_delete_range": {"key": b64(self._doc(k))}}, 0) for k in deletes]
        operations += [({"request_put": {"key": b64(self._event(s)), "value": b64(v)}}, len(v)) for s, v in events]
        with self._lock:
            batch: list[dict[str, Any]] = []
            size = 0
            for operation, length in operations:
                if batch and (len(batch) >= MAX_TXN_OPS or size + length > MAX_TXN_BYTES):
                    self._txn(batch)
                    batch, size = [], 0
                batch.append(operation)
                size += length
            if batch:
                self._txn(batch)

    def load_events(self, limit: int) -> list[str]:
        start = f"{self.prefix}/ev/"
        return list(reversed(self._range(start, _after(start), descend=True, limit=limit)))

    def prune_events(self, keep: int) -> None:
        start = f"{self.prefix}/ev/"
        reply = self._members.post("/kv/range", {
            "key": b64(start), "range_end": b64(_after(start)), "sort_target": "KEY", "sort_order": "DESCEND",
            "limit": 1, "keys_only": True})
        newest = reply.get("kvs", [])
        if not newest:
            return
        cut = int(_unb64(newest[0]["key"]).rsplit("/", 1)[1]) - keep   # drop sequences <= cut
        if cut < 0:
            return
        with self._lock:
            self._txn([{"request_delete_range": {"key": b64(start), "range_end": b64(self._event(cut + 1))}}])

    def close(self) -> None:
        self._members.close()


class StoreFenced(Unavailable):
    """A write refused because another controller owns the store now (this one was deposed)."""

    default_reason = Reason.STORE_FENCED


def parse_store_url(url: str) -> tuple[str, Any]:
    """``("sqlite", Path)`` or ``("etcd", (endpoints, prefix))`` for a ``store`` URL; ConfigError otherwise."""
    shown = url if len(url) <= 80 else url[:80] + "..."
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        if parts.netloc or not parts.path or parts.path.endswith("/"):
            raise ConfigError("store", f"{shown!r}: write sqlite:///ABSOLUTE/PATH/FILE.sqlite")
        return "sqlite", Path(parts.path)
    if parts.scheme == "etcd":
        if not parts.netloc:
            raise ConfigError("store", f"{shown!r}: write etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
        endpoints = []
        for member in parts.netloc.split(","):
            try:
                endpoints.append(parse_host_port(member, allow_zero_port=False))
            except ValueError:
                raise ConfigError("store", f"{shown!r}: etcd member {member[:40]!r} is not HOST:PORT "
                                           "(a port from 1 to 65535)") from None
        prefix = parts.path.rstrip("/") or "/rollmesh"
        if parts.query or parts.fragment or "//" in prefix:
            raise ConfigError("store", f"{shown!r}: the prefix must be a plain path such as /rollmesh")
        return "etcd", (endpoints, prefix)
    raise ConfigError("store", f"{shown!r}: the scheme must be sqlite:// or etcd://")


def parse_store(url: str, state_dir: str, tls: Any = None) -> StoreBackend | None:
    """The backend ``url`` names (``store``; ``tls`` for etcd), else SQLite in ``state_dir``, else None (keep
    nothing)."""
    if not url:
        return SqliteBackend(Path(state_dir) / "controller.sqlite") if state_dir else None
    kind, where = parse_store_url(url)
    if kind == "sqlite":
        return SqliteBackend(where)
    endpoints, prefix = where
    return EtcdBackend(endpoints, prefix, tls=tls)
