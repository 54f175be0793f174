"""One controller per etcd store: ownership by an etcd lease, with every write fenced.

Two controllers writing the same ``store`` prefix would corrupt the mesh's
state, so a controller on etcd first owns the store: it puts ``PREFIX/owner``
(its name and address) under a lease of ``store_lease_ttl_s`` seconds, in a
transaction that succeeds only while no one holds that key. Until it wins it
waits, serving nothing (a standby: it takes over once the owner stops, at once
when the owner shuts down cleanly and revokes its lease, within the TTL when
the owner dies). The owner renews the lease from a thread of its own every
TTL/3; every state write it makes carries the comparison "``PREFIX/owner``
still has the create revision I made it with" (:attr:`EtcdBackend.fence`), so
once its lease has run out (it was paused, cut off, or too slow) and another
controller owns the store, none of its writes lands. A controller that finds
it lost the store stops: ``on_lost`` (the process shuts down) runs at the first
failed renewal past the TTL or the first fenced write.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable

from mesh_runtime.retry import RetryPolicy

from .store_backends import EtcdBackend, StoreUnavailable, b64

log = logging.getLogger(__name__)


class _Owned(Exception):
    """Another process owns the store: :meth:`StoreOwnership.acquire` tries again at its next poll."""


class StoreOwnership:
    """Owns ``backend``'s prefix for this process, or waits until it can."""

    def __init__(self, backend: EtcdBackend, *, owner: str, ttl_s: int, on_lost: Callable[[str], None]) -> None:
        self.backend = backend
        self.owner = owner
        self.ttl_s = max(1, int(ttl_s))
        self.on_lost = on_lost
        self.key = f"{backend.prefix}/owner"
        self._members = backend.new_members()   # this thread's own sessions
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        self.previous = ""
        """The controller that held the store while this one waited ("" when it was free)."""
        self.waited_s = 0.0
        self.address = ""
        """HOST:PORT this controller serves on, in the owner key for standbys to name (publish_address)."""

    def holder(self) -> str:
        """Who owns the store now ("" when no one)."""
        return self.holder_info()[0]

    def holder_info(self) -> tuple[str, str]:
        """``(name, address)`` of the owner now (``("", "")`` when no one; the address is "" until it has
        published the one it serves on)."""
        reply = self._members.post("/kv/range", {"key": b64(self.key)})
        kvs = reply.get("kvs", [])
        if not kvs:
            return "", ""
        value = json.loads(base64.b64decode(kvs[0]["value"]))
        return str(value.get("owner", "")), str(value.get("address", ""))

    def try_acquire(self) -> bool:
        """One attempt to own the store (no waiting): on success the lease is kept from a thread."""
        started = time.monotonic()
        if not self._try_once():
            self.previous = self.holder() or self.previous
            return False
        self.waited_s += time.monotonic() - started
        self._start_keeping()
        return True

    def publish_address(self, address: str) -> None:
        """Put the address this owner serves on into the owner key (fenced: only while it still owns it), so
        standbys can point callers at it."""
        self.address = address
        value = json.dumps({"owner": self.owner, "address": address, "since": time.time()})
        key, revision = self.backend.fence or (self.key, 0)
        self._members.post("/kv/txn", {
            "compare": [{"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": revision}],
            "success": [{"request_put": {"key": b64(key), "value": b64(value), "lease": self._lease_id}}]})

    def acquire(self, *, poll_s: float | None = None, deadline_s: float | None = None) -> None:
        """Block until this process owns the store (log who holds it meanwhile); then keep it in a thread."""
        poll = poll_s if poll_s is not None else min(1.0, max(0.2, self.ttl_s / 4))   # a released store is taken
        # within a second; a dead owner's within its lease and a second
        started, told = time.monotonic(), ""

        def attempt() -> None:
            nonlocal told
            if self._try_once():
                return
            holder = self.holder()
            self.previous = holder or self.previous
            if holder != told:
                log.warning("state store %s is owned by %s; waiting to take over (lease %d s)",
                            self.backend.description, holder or "(released)", self.ttl_s)
                told = holder
            raise _Owned(holder)

        def failed(err: BaseException, wait: float) -> None:
            if isinstance(err, StoreUnavailable):
                log.warning("state store %s: %s; retrying in %.1f s", self.backend.description, err, wait)

        policy = RetryPolicy(initial_s=poll, max_s=poll, multiplier=1.0, within_s=deadline_s)
        try:
            policy.run_sync(attempt, retry_if=lambda err: isinstance(err, _Owned | StoreUnavailable), on_retry=failed)
        except _Owned:
            raise StoreUnavailable(f"could not own the state store within {deadline_s:g} s") from None
        self.waited_s = time.monotonic() - started
        self._start_keeping()

    def _start_keeping(self) -> None:
        log.info("owns the state store %s (lease %d s, fence revision %d)", self.backend.description, self.ttl_s,
                 self.fence_revision)
        self._thread = threading.Thread(target=self._keep, name="store-lease", daemon=True)
        self._thread.start()

    @property
    def fence_revision(self) -> int:
        return self.backend.fence[1] if self.backend.fence else 0

    def _try_once(self) -> bool:
        lease = int(self._members.post("/lease/grant", {"TTL": self.ttl_s, "ID": 0})["ID"])
        value = json.dumps({"owner": self.owner, "address": self.address, "since": time.time()})
        reply = self._members.post("/kv/txn", {
            "compare": [{"key": b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            "success": [{"request_put": {"key": b64(self.key), "value": b64(value), "lease": lease}}]})
        if not reply.get("succeeded", False):
            self._revoke(lease)
            return False
        self._lease_id = lease
        self.backend.fence = (self.key, int(reply["header"]["revision"]))
        return True

    def _revoke(self, lease: int) -> None:
        try:
            self._members.post("/kv/lease/revoke", {"ID": lease})
        except (StoreUnavailable, self.backend.errors.Etcd3Exception):
            pass   # it expires by itself

    def _keep(self) -> None:
        """Renew the lease every TTL/3; past the TTL without a renewal (or once etcd says it is gone) the store
        is lost."""
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                left = int(self._members.post("/lease/keepalive", {"ID": self._lease_id}).get("result", {}).get("TTL", -1))
            except (StoreUnavailable, self.backend.errors.Etcd3Exception) as err:
                if time.monotonic() - last_ok > self.ttl_s:
                    self.lose(f"no renewal for {time.monotonic() - last_ok:.1f} s ({err})")
                    return
                continue   # the next renewal may still make it in time
            if left <= 0:
                self.lose("etcd says its lease has expired")
                return
            last_ok = time.monotonic()

    def lose(self, why: str) -> None:
        """This controller no longer owns the store: stop renewing and tell the process (once)."""
        if self.lost:
            return
        self.lost = True
        self._stop.set()
        log.critical("lost the state store %s: %s; stopping", self.backend.description, why)
        self.on_lost(why)

    def release(self) -> None:
        """Give the store up (clean shutdown): a waiting controller takes over at once."""
        self._stop.set()
        if self._lease_id is not None and not self.lost:
            self._revoke(self._lease_id)
        self._lease_id = None
        self._members.close()
