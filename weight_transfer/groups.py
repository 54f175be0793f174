"""Process groups for weight transfers, made per member set and cached.

A transfer runs on a :class:`TransferGroup`: a gloo (CPU) or NCCL (GPU)
process group over an ordered member list whose first member (rank 0) is the
sender. :class:`GroupCache` builds them without a default process group: the
sender hosts one long-lived ``TCPStore`` at its rendezvous address, the other
members connect to it as clients, and each group rendezvouses under its own
key prefix of that store. Syncs to the same member set reuse the group.

Group ids
---------
The store prefix is derived from ``(group_id, members, backend)``. A group
that was evicted, closed or broken by a failure is *retired*: asking for the
same key again raises :class:`GroupClosed`, because the old group's keys are
still in the store and a second rendezvous under them could pair a member
with stale addresses. After a failure the controller names a new group id.

Timeouts
--------
``setup_timeout_s`` bounds group creation end to end (connecting to the
store, waiting for every member to arrive, connecting the pairs); a member
that never shows up ends it with :class:`TransferTimeout`. ``op_timeout_s``
becomes the group's default timeout for each collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import logging
import socket
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mesh_runtime.config import ConfigError, setting
from mesh_runtime.retry import RetryPolicy

from .errors import GroupBusy, GroupClosed, PeerLost, TransferTimeout, WeightTransferError
from .manifest import CHECKSUM_ALGORITHMS

T = TypeVar("T")

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


@dataclasses.dataclass
class WeightTransferConfig:
    """Settings of the weight transfer; server configs nest this as ``weight_transfer``."""

    bucket_size_bytes: int = setting(16 << 20, help="bytes per broadcast bucket; tensors are split "
                                                    "across buckets, so every bucket but the last is full")
    setup_timeout_s: float = setting(60.0, help="seconds to create a process group, including waiting "
                                               "for every member to arrive")
    op_timeout_s: float = setting(60.0, help="seconds each collective (one bucket) may take before "
                                             "the transfer fails")
    ring_size: int = setting(3, help="packing buffers the sender cycles through: bucket k+1 is packed "
                                     "while up to ring_size-1 earlier buckets are in flight")
    topology: str = setting("auto", help="'broadcast' (the backend's own algorithm), 'chain' (rank r "
                                         "relays each bucket to rank r+1; gloo only) or 'auto' (chain "
                                         "on gloo, broadcast on NCCL); all members must agree")
    checksum_algorithm: str = setting("wsum64", help="'wsum64' (fastest, runs on the GPU), 'crc32' or "
                                                     "'sha256'; see weight_transfer.manifest")
    gloo_interface: str = setting("", help="network interface gloo binds to, e.g. 'lo' on loopback; "
                                           "empty = gloo's default device")
    gloo_threads: int = setting(2, help="gloo worker threads per group (collectives in flight at once)")
    delta_max_ratio: float = setting(0.5, help="trainer side: a new version is offered as a delta from the "
                                               "version the receivers hold when the delta's bytes are at most "
                                               "this share of the full weights (weight_transfer.delta); 0 = "
                                               "never, and no copy of the previous version is kept")
    delta_bucket_ratio: float = setting(0.5, help="trainer side: a bucket of a delta is sent whole once its "
                                                  "changed words (with their indices or bitmap) take more than "
                                                  "this share of its bytes")
    delta_history: int = setting(8, help="trainer side: the deltas of this many recent versions are kept (in host "
                                         "memory, at most one model's bytes in all), so a replica that many "
                                         "versions behind catches up by one delta composed of them; 0 = only "
                                         "a replica at the version before gets a delta")
    rendezvous_ports: str = setting("", help="LOW-HIGH: the ports a rendezvous store asked for on port 0 "
                                             "binds in (the first free one), so a firewall can be opened "
                                             "for them; empty = any free port")

    def port_range(self) -> tuple[int, int] | None:
        """``rendezvous_ports`` as (low, high), or None for any port."""
        if not self.rendezvous_ports:
            return None
        low, sep, high = self.rendezvous_ports.partition("-")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ConfigError("rendezvous_ports", f"must be LOW-HIGH, e.g. 29500-29599, got "
                                                  f"{self.rendezvous_ports[:40]!r}")
        low_port, high_port = int(low), int(high)
        if not 1 <= low_port <= high_port <= 65535:
            raise ConfigError("rendezvous_ports", f"needs 1 <= LOW <= HIGH <= 65535, got {low_port}-{high_port}")
        return low_port, high_port

    def validate(self) -> None:
        self.port_range()
        if self.bucket_size_bytes <= 0:
            raise ConfigError("bucket_size_bytes", f"must be positive, got {self.bucket_size_bytes}")
        for key in ("setup_timeout_s", "op_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be a positive number of seconds, got {getattr(self, key)}")
        if not 0 <= self.delta_max_ratio <= 1:
            raise ConfigError("delta_max_ratio", f"must be in [0, 1] (0 = no deltas), got {self.delta_max_ratio}")
        if self.delta_history < 0:
            raise ConfigError("delta_history", f"must be >= 0, got {self.delta_history}")
        if not 0 < self.delta_bucket_ratio <= 1:
            raise ConfigError("delta_bucket_ratio", f"must be in (0, 1], got {self.delta_bucket_ratio}")
        if self.ring_size < 2:
            raise ConfigError("ring_size", f"must be at least 2 to overlap packing and sending, "
                                           f"got {self.ring_size}")
        if self.topology not in ("auto", "broadcast", "chain"):
            raise ConfigError("topology", f"must be 'auto', 'broadcast' or 'chain', got {self.topology!r}")
        if self.checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise ConfigError("checksum_algorithm", f"must be one of {CHECKSUM_ALGORITHMS}, "
                                                    f"got {self.checksum_algorithm!r}")
        if self.gloo_threads < 1:
            raise ConfigError("gloo_threads", f"must be at least 1, got {self.gloo_threads}")


@dataclasses.dataclass(frozen=True)
class GroupKey:
    """What identifies a cached group. ``members[0]`` is the sender and store host."""

    group_id: str
    members: tuple[str, ...]
    backend: str

    def store_prefix(self, secret: bytes = b"") -> str:
        """The rendezvous keys' prefix; with the plan's ``secret`` it also holds a tag of the secret, so a
        process without it cannot find the group's keys, let alone claim a rank."""
        digest = hashlib.sha1("\0".join(self.members).encode()).hexdigest()[:16]
        keyed = hmac.new(secret, b"rollmesh rendezvous\0" + self.group_id.encode(), hashlib.sha256).hexdigest()[:32] \
            if secret else "open"
        return f"rollmesh/weights/{self.group_id}/{self.backend}/{digest}/{keyed}/"


class TransferGroup:
    """A live process group plus what a transfer needs to know about it.

    Only one transfer may run on a group at a time (:meth:`claim`). A failed
    transfer marks the group broken; it is then unusable and its cache
    retires it.
    """

    def __init__(self, key: GroupKey, rank: int, backend_group: Any, device: torch.device,
                 op_timeout: datetime.timedelta, *, topology: str = "auto", ring_size: int = 3) -> None:
        self.key = key
        self.rank = rank
        self.world_size = len(key.members)
        self.backend_group = backend_group
        self.device = device
        self.op_timeout = op_timeout
        self.topology = topology  # defaults for transfers on this group (from the cache's config)
        self.ring_size = ring_size
        self.broken: str | None = None
        self.closed = False
        self._busy = threading.Lock()
        self._staging: list[torch.Tensor] = []

    def staging_buffers(self, count: int, nbytes: int) -> list[torch.Tensor]:
        """``count`` uint8 buffers of ``nbytes`` on the group's device, kept for the next send.

        Reusing them spares every send the page faults of fresh memory, which
        cost several times the copy itself here (0.09 s against 0.014 s for
        filling 256 MiB fresh or reused).
        """
        if len(self._staging) != count or (count and self._staging[0].numel() != nbytes):
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        return self._staging

    @property
    def backend(self) -> str:
        return self.key.backend

    def claim(self) -> _Claim:
        """Context manager that holds the group for one transfer; raises if it is unusable or busy."""
        return _Claim(self)

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            log.warning("weight group %s is broken: %s", self.key.group_id, reason)

    def check_usable(self) -> None:
        if self.closed:
            raise GroupClosed(f"weight group {self.key.group_id!r} is closed")
        if self.broken is not None:
            raise GroupClosed(f"weight group {self.key.group_id!r} is broken ({self.broken}); "
                              f"start a new sync under a new group id")

    def close(self) -> None:
        """Release the backend group; peers still using it see their next operation fail.

        gloo closes its connections when the group object is destroyed (its
        ``shutdown``/``abort`` leave them open), so this drops the reference;
        NCCL communicators are shut down explicitly.
        """
        self.closed = True
        self._staging = []
        pg, self.backend_group = self.backend_group, None
        if pg is not None and self.key.backend == "nccl":
            pg.shutdown()


class _Claim:
    def __init__(self, group: TransferGroup) -> None:
        self._group = group

    def __enter__(self) -> TransferGroup:
        self._group.check_usable()
        if not self._group._busy.acquire(blocking=False):
            raise GroupBusy(f"a transfer is already running on weight group {self._group.key.group_id!r}")
        return self._group

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        try:
            if exc is not None:
                # Closing now (not when the cache retires it) makes the peers'
                # pending operations fail at once instead of at their timeout.
                self._group.mark_broken(f"{type(exc).__name__}: {exc}")
                self._group.close()
        finally:
            self._group._busy.release()


def translate_error(err: BaseException, what: str) -> WeightTransferError:
    """Turn a torch.distributed / gloo error into a timeout or a lost-peer error."""
    if isinstance(err, WeightTransferError):
        return err
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "timeout" in text.lower() or "timed out" in text.lower():
        return TransferTimeout(f"{what} timed out: {text}")
    return PeerLost(f"{what} failed: {text}")


def _in_use(err: Exception) -> bool:
    text = str(err).lower()
    return "address already in use" in text or "errno: 98" in text or "eaddrinuse" in text


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Retry connecting to ``host:port`` until something listens there or ``deadline`` passes.

    Done before creating the ``TCPStore`` client, whose own retry loop can
    overrun its timeout by a back-off delay of seconds.
    """
    def connect() -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"no rendezvous store is listening at {host}:{port}")
        socket.create_connection((host, port), timeout=remaining).close()

    try:
        policy = RetryPolicy(initial_s=0.02, max_s=0.5, within_s=max(0.0, deadline - time.monotonic()),
                             try_at_bound=True)
        policy.run_sync(connect, retry_if=lambda err: isinstance(err, OSError))
    except OSError:
        raise TransferTimeout(f"no rendezvous store is listening at {host}:{port}") from None


def _call_with_deadline(build: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``build()`` in a helper thread; give up at ``deadline`` (monotonic seconds).

    On giving up the helper is left to finish on its own, and whatever it
    builds is dropped (a group object closes its connections when collected).
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = build()
        except BaseException as err:  # handed to the caller below
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name="weight-group-setup", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0)):
        log.warning("%s: still blocked at its deadline; abandoning it", what)
        raise TransferTimeout(f"{what} timed out: not every member joined in time")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class GroupCache:
    """Creates, caches and closes the transfer groups of one process (member ``self_id``).

    Thread-safe: different keys may be built concurrently (each construction
    talks to the store over its own connection); the same key is built once.
    """

    def __init__(self, self_id: str, config: WeightTransferConfig | None = None) -> None:
        self.self_id = self_id
        self.config = config or WeightTransferConfig()
        self.config.validate()
        self.constructions = 0
        self._groups: dict[GroupKey, TransferGroup] = {}
        self._retired: set[GroupKey] = set()
        self._key_locks: dict[GroupKey, threading.Lock] = {}
        self._stores: dict[tuple[str, int], dist.Store] = {}
        self._hosted: dict[int, dist.TCPStore] = {}  # by port: one server per port
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> GroupCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- rendezvous stores -------------------------------------------------------------------

    def host_rendezvous(self, host: str, port: int = 0) -> int:
        """Start this member's TCPStore server on ``host:port`` (0 = any free port); return the port.

        A sender calls this once at start and advertises the address; groups it
        leads on that port rendezvous there. Calling it again for a port it
        already serves returns at once.
        """
        with self._lock:
            self._check_open()
            if port and port in self._hosted:
                return port
            ports = self.config.port_range() if not port else None
            candidates = range(ports[0], ports[1] + 1) if ports else [port]
            for candidate in candidates:
                try:
                    store = dist.TCPStore(host, candidate, None, True, self._setup_timeout(), wait_for_workers=False)
                except Exception as err:  # noqa: BLE001 - torch raises a bare error for a port in use
                    if ports is None or not _in_use(err):
                        raise
                    continue
                self._hosted[store.port] = store
                return store.port
            assert ports is not None   # a given port that fails raises in the loop
            raise WeightTransferError(f"no free port for a rendezvous store on {host} in rendezvous_ports "
                                      f"{ports[0]}-{ports[1]}")

    def _store_for(self, host: str, port: int, leader: bool, deadline: float) -> dist.Store:
        if leader:
            self.host_rendezvous(host, port)
            with self._lock:
                return self._hosted[port]
        with self._lock:
            store = self._stores.get((host, port))
        if store is None:
            _wait_for_listener(host, port, deadline)
            remaining = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                store = dist.TCPStore(host, port, None, False, remaining)
            except Exception as err:
                raise translate_error(err, f"connecting to the rendezvous store at {host}:{port}") from err
            with self._lock:
                store = self._stores.setdefault((host, port), store)
        return store

    # -- groups ----------------------------------------------------------------------------

    def get(self, group_id: str, members: Sequence[str], rendezvous: tuple[str, int],
            backend: str = "gloo", secret: bytes = b"") -> TransferGroup:
        """The group of ``members`` (sender first) named ``group_id``, built on first use.

        ``rendezvous`` is the sender's store address; ``secret`` (the plan's
        sync key) keys the rendezvous when the group is built (every member must
        pass the same one; a cached group is reused as is). Blocks until every member
        has joined or ``setup_timeout_s`` passes (:class:`TransferTimeout`).
        Raises :class:`GroupClosed` for a retired key, ``ValueError`` if this
        member is not in ``members`` or the backend is unknown.
        """
        key = GroupKey(group_id, tuple(members), backend)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if self.self_id not in key.members or len(set(key.members)) != len(key.members):
            raise ValueError(f"members {list(key.members)} must be distinct and include {self.self_id!r}")
        if key.members[0] == self.self_id and not rendezvous[1]:
            raise ValueError("the sender needs a concrete rendezvous port (host_rendezvous() picks one)")
        with self._lock:
            self._check_open()
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                group = self._groups.get(key)
                if group is not None and group.broken is not None:
                    self._retire_locked(key)
                    group = None
                if key in self._retired:
                    raise GroupClosed(f"weight group {group_id!r} with members {list(key.members)} "
                                      f"was closed or broke; use a new group id")
            if group is None:
                group = self._build(key, rendezvous, secret)
                with self._lock:
                    if self._closed:
                        group.close()
                        raise GroupClosed("the group cache is closed")
                    self._groups[key] = group
                    self.constructions += 1
            return group

    def evict(self, group_id: str, members: Sequence[str], backend: str = "gloo") -> bool:
        """Close and retire one group; returns whether it was cached."""
        key = GroupKey(group_id, tuple(members), backend)
        with self._lock:
            return self._retire_locked(key)

    def close(self) -> None:
        """Close every group and store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for key in list(self._groups):
                self._retire_locked(key)
            self._stores.clear()
            self._hosted.clear()

    def cached_keys(self) -> list[GroupKey]:
        with self._lock:
            return list(self._groups)

    def _retire_locked(self, key: GroupKey) -> bool:
        self._retired.add(key)
        group = self._groups.pop(key, None)
        if group is not None:
            group.close()
        return group is not None

    def _check_open(self) -> None:
        if self._closed:
            raise GroupClosed("the group cache is closed")

    def _setup_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.setup_timeout_s)

    def _build(self, key: GroupKey, rendezvous: tuple[str, int], secret: bytes = b"") -> TransferGroup:
        deadline = time.monotonic() + self.config.setup_timeout_s
        rank = key.members.index(self.self_id)
        what = f"creating weight group {key.group_id!r} (rank {rank} of {len(key.members)})"
        try:
            # torch's own timeouts are set to the same deadline and normally fire
            # first; the outer bound catches the cases where they do not (a
            # member dying halfway through gloo's pair connection can leave the
            # constructor waiting well past them).
            grace = 1.0 + 0.1 * self.config.setup_timeout_s
            return _call_with_deadline(lambda: self._construct(key, rendezvous, rank, deadline, secret),
                                       deadline + grace, what)
        except Exception as err:
            if rank != 0:
                with self._lock:  # the sender may have restarted; reconnect next time
                    self._stores.pop((rendezvous[0], rendezvous[1]), None)
            if isinstance(err, WeightTransferError) or not isinstance(err, RuntimeError):
                raise
            raise translate_error(err, what) from err  # torch.distributed / gloo / NCCL errors

    def _construct(self, key: GroupKey, rendezvous: tuple[str, int], rank: int,
                   deadline: float, secret: bytes = b"") -> TransferGroup:
        host, port = rendezvous
        base = self._store_for(host, port, rank == 0, deadline)
        # Own connection per construction: a blocking wait on a shared client
        # would stall every other construction in this process.
        conn: Any = base.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        conn.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        store = dist.PrefixStore(key.store_prefix(secret), conn)
        op_timeout = datetime.timedelta(seconds=self.config.op_timeout_s)
        if key.backend == "gloo":
            pg, device = self._build_gloo(store, rank, len(key.members), op_timeout, deadline)
        else:
            pg, device = self._build_nccl(store, rank, len(key.members), op_timeout, deadline)
        log.info("weight group %s built: rank %d of %d (%s)", key.group_id, rank, len(key.members),
                 key.backend)
        return TransferGroup(key, rank, pg, device, op_timeout, topology=self.config.topology,
                             ring_size=self.config.ring_size)

    def _build_gloo(self, store: dist.Store, rank: int, size: int, op_timeout: datetime.timedelta,
                    deadline: float) -> tuple[object, torch.device]:
        gloo: Any = dist.ProcessGroupGloo   # _Options: private, not in the stubs
        options = gloo._Options()
        # gloo's rendezvous waits use the group timeout, so it starts as what is
        # left of the setup budget and becomes op_timeout once the group is up.
        options._timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        options._threads = self.config.gloo_threads
        if self.config.gloo_interface:
            options._devices = [dist.ProcessGroupGloo.create_device(interface=self.config.gloo_interface)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, size, options)
        pg._set_default_timeout(op_timeout)
        return pg, torch.device("cpu")

    def _build_nccl(self, store: dist.Store, rank: int, size: int, op_timeout: datetime.timedelta,
                    deadline: float) -> tuple[object, torch.device]:
        nccl_group = getattr(dist, "ProcessGroupNCCL", None)
        if nccl_group is None or not torch.cuda.is_available():
            raise WeightTransferError("the NCCL backend needs a CUDA build of torch and a GPU")
        # The caller has selected this process's GPU with torch.cuda.set_device().
        device = torch.device("cuda", torch.cuda.current_device())
        options = nccl_group.Options()
        options._timeout = op_timeout
        pg = nccl_group(store, rank, size, options)  # the NCCL id exchange waits on the store's timeout
        # NCCL connects lazily; a one-element broadcast forces the communicator
        # up now, so a missing member fails here within the setup timeout.
        probe = torch.zeros(1, device=device)
        remaining = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        pg.broadcast(probe, 0, remaining).wait(remaining)
        return pg, device
