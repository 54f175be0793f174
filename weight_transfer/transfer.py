"""Moving the bytes: a pipelined, bucketed broadcast from rank 0 to every other member.

The sender packs bucket k+1 into one of ``ring_size`` staging buffers while
earlier buckets are still in flight (``async_op`` collectives), so the sender
adds a memory copy per byte but no idle gaps (a bucket lying inside one
tensor is sent straight from it). Receivers receive each bucket straight into
its place in one buffer of ``total_bytes`` (fresh, or a staging buffer the
caller passes) and hash it while the next buckets arrive; the returned
tensors are views into that buffer, so nothing the caller is serving from is
touched until it swaps them in.

Topologies (every member of a transfer must use the same one):

``broadcast``
    The backend's broadcast per bucket (gloo: a binomial tree, so with
    several buckets in flight the tree is pipelined too; NCCL: its own
    pipelined ring).
``chain``
    Rank r receives each bucket from r-1 and forwards it to r+1 while the
    next bucket arrives, so no member sends or receives more than one copy.
    With links as the bottleneck, time to n receivers is about
    ``T1 * (1 + (n-1) / buckets)``. gloo only. On the 2-core benchmark box
    it was as fast as gloo's tree or faster (the sender sends one copy, not
    one per child), and each member's CPU time barely grows with n.
``auto`` (default)
    ``chain`` on gloo, ``broadcast`` on NCCL.

Authenticated broadcasts (``key``, the plan's per-sync secret): before any
bucket, the sender sends its manifest tag (:func:`~.manifest.manifest_tag`);
each receiver compares it with the tag of its own manifest and checks every
bucket against the manifest's BLAKE3 bucket digest as it arrives. A failed
check still receives (and forwards) the whole stream, so the group stays in
step, and then raises :class:`NotAuthentic`: the caller swaps nothing in.

Every blocking step is bounded by the group's ``op_timeout`` (or the
``timeout`` argument). Any failure other than a checksum mismatch marks the
group broken (see :mod:`weight_transfer.groups`).

These functions block; servers run them with :func:`asyncio.to_thread`, or
call the ``*_async`` wrappers, which also turn cancellation of the awaiting
task into :class:`TransferCancelled` inside the worker thread. Cancellation
is checked between buckets: a bucket already waiting ends when it arrives
or at its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hmac
import json
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import ChecksumMismatch, GroupClosed, ManifestMismatch, NotAuthentic, TransferCancelled
from .groups import TransferGroup, translate_error
from .manifest import (Manifest, StreamHasher, TensorEntry, bucket_digest, dtype_name, manifest_tag, tensor_bytes,
                       views_of)

TOPOLOGIES = ("auto", "broadcast", "chain")

BucketHook = Callable[[int, torch.Tensor], None]

_TAG_INDEX = 1 << 24
"""The point-to-point tag of the manifest-tag message (buckets use their index)."""
TAG_BYTES = 32

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SendResult:
    """What one send moved: stream bytes (padding included), wall seconds, bucket count."""

    bytes: int
    seconds: float
    buckets: int


class _Link:
    """Posts one topology's per-bucket operations on a group and waits on them with timeouts."""

    def __init__(self, group: TransferGroup, topology: str | None, timeout: float | None) -> None:
        topology = group.topology if topology is None else topology
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        if topology == "auto":
            topology = "chain" if group.backend == "gloo" else "broadcast"
        if topology == "chain" and group.backend != "gloo":
            raise ValueError("the chain topology is implemented for gloo only; NCCL pipelines its own")
        self._group = group
        self.rank = group.rank
        self.size = group.world_size
        self.chain = topology == "chain"
        self.nccl = group.backend == "nccl"
        self.timeout = (datetime.timedelta(seconds=timeout) if timeout is not None
                        else group.op_timeout)

    @property
    def pg(self) -> dist.ProcessGroup:
        # Read through the group each time: once it is closed nothing here may
        # keep the backend group (and so its connections) alive.
        pg = self._group.backend_group
        if pg is None:
            raise GroupClosed(f"weight group {self._group.key.group_id!r} was closed during the transfer")
        return pg

    def send(self, index: int, buf: torch.Tensor) -> list[dist.Work]:
        """Rank 0: start sending bucket ``index``."""
        if self.size == 1:
            return []
        if self.chain:
            return [self._call(lambda: self.pg.send([buf], 1, index), index)]
        return [self._call(lambda: self.pg.broadcast(buf, 0, self.timeout), index)]

    def receive(self, index: int, buf: torch.Tensor) -> dist.Work:
        """Other ranks: start receiving bucket ``index`` into ``buf``."""
        if self.chain:
            return self._call(lambda: self.pg.recv([buf], self.rank - 1, index), index)
        return self._call(lambda: self.pg.broadcast(buf, 0, self.timeout), index)

    def forward(self, index: int, buf: torch.Tensor) -> dist.Work | None:
        """Chain relays: start passing a received bucket on to the next rank."""
        if not self.chain or self.rank + 1 >= self.size:
            return None
        return self._call(lambda: self.pg.send([buf], self.rank + 1, index), index)

    def wait(self, work: dist.Work, what: str) -> None:
        try:
            if self.nccl or self.chain:
                work.wait(self.timeout)
            else:
                work.wait()  # the gloo broadcast carries its own timeout
        except Exception as err:
            # The traceback keeps this frame alive; a work object left in it
            # would keep the group's connections open after the group is
            # closed, and the peers would wait for their timeouts.
            del work
            raise translate_error(err, what) from err

    @staticmethod
    def _call(post: Callable[[], T], index: int) -> T:
        try:
            return post()
        except Exception as err:
            raise translate_error(err, f"starting bucket {index}") from err


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise TransferCancelled("the weight transfer was cancelled")


class StreamPacker:
    """Copies the sender's tensors, in manifest order, into consecutive stream windows.

    Each tensor is checked against its manifest entry (name, dtype, shape)
    when it is reached; a difference raises :class:`ManifestMismatch`.
    """

    def __init__(self, manifest: Manifest, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._manifest = manifest
        self._entries = iter(manifest.tensors)
        self._tensors = iter(named_tensors)
        self._src: torch.Tensor | None = None
        self._src_start = 0
        self._src_end = 0

    def direct_view(self, start: int, stop: int, device: torch.device) -> torch.Tensor | None:
        """Stream bytes ``[start, stop)`` as a view of one source tensor, if they lie inside one.

        Spares the copy into a staging buffer for buckets inside big tensors.
        """
        if start >= self._src_end:
            self._next_source()
        if (self._src is not None and self._src_start <= start and stop <= self._src_end
                and self._src.device == device):
            return self._src[start - self._src_start:stop - self._src_start]
        return None

    def fill(self, buf: torch.Tensor, start: int) -> None:
        """Write stream bytes ``[start, start + len(buf))`` into ``buf``."""
        pos, end = start, start + buf.numel()
        while pos < end:
            if pos >= self._src_end:
                self._next_source()
            if pos < self._src_start:  # alignment padding before the next tensor
                n = min(self._src_start, end) - pos
                buf[pos - start:pos - start + n].zero_()
            else:
                n = min(self._src_end, end) - pos
                offset = pos - self._src_start
                assert self._src is not None   # _next_source set it
                buf[pos - start:pos - start + n].copy_(self._src[offset:offset + n])
            pos += n

    def finish(self) -> None:
        """Check that the sender's tensors ended where the manifest did."""
        for entry in self._entries:
            if entry.nbytes:
                raise ManifestMismatch(f"tensor {entry.name!r} was never packed", tensor_name=entry.name)
            self._take(entry)
        extra = next(self._tensors, None)
        if extra is not None:
            raise ManifestMismatch(f"the sender has tensor {extra[0]!r}, which the manifest lacks",
                                   tensor_name=extra[0])

    def _next_source(self) -> None:
        for entry in self._entries:
            tensor = self._take(entry)
            if entry.nbytes:
                self._src = tensor_bytes(tensor)
                self._src_start = self._manifest.stream_offset(entry)
                self._src_end = self._src_start + entry.nbytes
                return
        self._src = None  # nothing left: the rest of the stream is padding
        self._src_start = self._src_end = self._manifest.total_bytes

    def _take(self, entry: TensorEntry) -> torch.Tensor:
        item = next(self._tensors, None)
        if item is None:
            raise ManifestMismatch(f"the sender has no tensor {entry.name!r}", tensor_name=entry.name)
        name, tensor = item
        got = (name, dtype_name(tensor.dtype), tuple(tensor.shape))
        if got != (entry.name, entry.dtype, entry.shape):
            raise ManifestMismatch(f"the sender's tensor {name!r} is {got[1]} {list(got[2])} where the "
                                   f"manifest expects {entry.name!r} {entry.dtype} {list(entry.shape)}",
                                   tensor_name=entry.name)
        return tensor


def send_weights(group: TransferGroup, manifest: Manifest,
                 named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                 topology: str | None = None, ring_size: int | None = None, timeout: float | None = None,
                 cancel: threading.Event | None = None,
                 bucket_hook: BucketHook | None = None, key: bytes = b"") -> SendResult:
    """Rank 0: send ``named_tensors`` (in manifest order) to every other member.

    ``named_tensors`` may be a generator; it is read once, in step with the
    transfer, and the tensors must not change until this returns (a bucket
    that lies inside one tensor is sent from it without a copy).
    ``topology`` and ``ring_size`` default to the group's (its cache's
    config); ``timeout`` (seconds) overrides the group's per-bucket timeout.
    ``bucket_hook(index, packed_bucket)`` runs after a bucket is packed and
    before it is sent (tests use it to corrupt a byte; it disables the
    no-copy path). With ``key`` the broadcast is authenticated: the manifest
    tag goes first (receivers need the same key and bucket digests).

    Raises :class:`ManifestMismatch` if the tensors differ from the manifest,
    :class:`TransferTimeout` / :class:`PeerLost` if a receiver fails,
    :class:`TransferCancelled` if ``cancel`` is set, :class:`GroupClosed` if
    the group is unusable.
    """
    if group.rank != 0:
        raise ValueError(f"only rank 0 sends; this member is rank {group.rank}")
    ring_size = group.ring_size if ring_size is None else ring_size
    if ring_size < 2:
        raise ValueError(f"ring_size must be at least 2, got {ring_size}")
    with group.claim():
        link = _Link(group, topology, timeout)
        packer = StreamPacker(manifest, named_tensors)
        count = manifest.num_buckets
        started = time.perf_counter()
        ring = group.staging_buffers(min(ring_size, count),
                                     min(manifest.bucket_size_bytes, manifest.total_bytes))
        in_flight: collections.deque = collections.deque()
        tag_works: list = []
        try:
            if key:   # the tag goes first; the buckets follow without waiting for it (collectives keep order)
                tag = torch.frombuffer(bytearray(manifest_tag(key, manifest)), dtype=torch.uint8).to(group.device)
                tag_works = link.send(_TAG_INDEX, tag)
            for index in range(count):
                _check_cancel(cancel)
                if len(in_flight) == len(ring):
                    _wait_all(link, *in_flight.popleft())
                start, stop = manifest.bucket_range(index)
                buf = packer.direct_view(start, stop, group.device) if bucket_hook is None else None
                if buf is None:
                    buf = ring[index % len(ring)][:stop - start]
                    packer.fill(buf, start)
                if index == count - 1:
                    packer.finish()
                if bucket_hook is not None:
                    bucket_hook(index, buf)
                in_flight.append((index, link.send(index, buf)))
            if count == 0:
                packer.finish()
            _wait_all(link, _TAG_INDEX, tag_works)
            while in_flight:
                _wait_all(link, *in_flight.popleft())
        except BaseException:
            in_flight.clear()  # pending work objects would keep the connections open
            tag_works.clear()
            raise
        return SendResult(bytes=manifest.total_bytes, seconds=time.perf_counter() - started, buckets=count)


def _wait_all(link: _Link, index: int, works: list) -> None:
    while works:  # popped, so a failure leaves no work referenced from this frame
        link.wait(works.pop(0), f"sending bucket {index}")


def receive_weights(group: TransferGroup, manifest: Manifest, *, topology: str | None = None,
                    timeout: float | None = None, verify: bool = True, window: int = 4,
                    out: torch.Tensor | None = None,
                    cancel: threading.Event | None = None, key: bytes = b"") -> dict[str, torch.Tensor]:
    """Other ranks: receive the weights ``manifest`` describes; return them by name.

    The tensors have the manifest's dtypes and shapes and are views into one
    buffer: a fresh one on the group's device, or ``out`` -- a 1-D uint8
    buffer of at least ``total_bytes`` that nothing else reads meanwhile (a
    staging buffer kept between syncs saves the page faults of fresh memory,
    which on this machine more than doubled the time of a 256 MiB transfer).
    ``window`` buckets are posted ahead of the one being waited for;
    ``topology`` defaults to the group's. With ``verify`` the stream is
    hashed as it arrives and :class:`ChecksumMismatch` raised if it differs
    from ``manifest.checksum``. With ``key`` (an authenticated broadcast) the
    sender's manifest tag and every bucket's BLAKE3 digest are checked instead,
    whatever ``verify`` says, and :class:`NotAuthentic` raised on a failure
    (after the whole stream has passed, so the group stays usable). Other
    errors as for :func:`send_weights`.
    """
    if group.rank == 0:
        raise ValueError("rank 0 is the sender; it cannot receive")
    manifest.check_layout()  # views into the buffer must stay inside it and aligned
    if key and len(manifest.bucket_digests) != manifest.num_buckets:
        raise NotAuthentic("an authenticated weight broadcast needs a manifest with bucket digests; "
                           "this one has none (a sender that predates them?)")
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    with group.claim():
        link = _Link(group, topology, timeout)
        if out is None:
            flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=group.device)
        elif (out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous()
              or out.numel() < manifest.total_bytes or out.device != group.device):
            raise ValueError(f"out must be a contiguous 1-D uint8 tensor of at least {manifest.total_bytes} "
                             f"bytes on {group.device}")
        else:
            flat = out[:manifest.total_bytes]
        hasher = StreamHasher(manifest.checksum_algorithm) if verify and not key else None
        count = manifest.num_buckets
        posted: collections.deque = collections.deque()
        forwards: collections.deque = collections.deque()
        next_to_post = 0
        problem = ""
        try:
            if key:
                tag = torch.empty(TAG_BYTES, dtype=torch.uint8, device=group.device)
                posted.append(link.receive(_TAG_INDEX, tag))
                # the first buckets are posted before the tag is waited for (collectives keep their order);
                # nothing is kept or forwarded before the tag is checked
                while next_to_post < count and len(posted) <= window:
                    start, stop = manifest.bucket_range(next_to_post)
                    posted.append(link.receive(next_to_post, flat[start:stop]))
                    next_to_post += 1
                link.wait(posted.popleft(), "receiving the manifest tag")
                forward = link.forward(_TAG_INDEX, tag)
                if forward is not None:
                    forwards.append((_TAG_INDEX, [forward]))
                    forward = None
                if not hmac.compare_digest(bytes(tag.cpu().numpy()), manifest_tag(key, manifest)):
                    problem = ("the sender's manifest tag does not match this plan's key and manifest: the sender "
                               "is not the one the controller chose, or the manifests differ")
            for index in range(count):
                _check_cancel(cancel)
                while next_to_post < count and len(posted) < window:
                    start, stop = manifest.bucket_range(next_to_post)
                    posted.append(link.receive(next_to_post, flat[start:stop]))
                    next_to_post += 1
                link.wait(posted.popleft(), f"receiving bucket {index}")
                start, stop = manifest.bucket_range(index)
                forward = link.forward(index, flat[start:stop])
                if forward is not None:
                    forwards.append((index, [forward]))
                    forward = None  # only the deque may hold works (see _Link.wait)
                    if len(forwards) > window:
                        _wait_all(link, *forwards.popleft())
                if hasher is not None:
                    hasher.update(flat[start:stop])
                if key and not problem and bucket_digest(flat[start:stop]) != manifest.bucket_digests[index]:
                    problem = f"bucket {index} of {count} does not match its BLAKE3 digest in the manifest"
            while forwards:
                _wait_all(link, *forwards.popleft())
        except BaseException:
            posted.clear()  # pending work objects would keep the connections open
            forwards.clear()
            raise
    if problem:
        raise NotAuthentic(f"weights not authentic: {problem}")
    if hasher is not None and hasher.hexdigest() != manifest.checksum:
        raise ChecksumMismatch(manifest.checksum, hasher.hexdigest(), manifest.checksum_algorithm)
    return views_of(manifest, flat)


def broadcast_manifest(group: TransferGroup, manifest: Manifest | None = None, *,
                       timeout: float | None = None) -> Manifest:
    """Standalone use: rank 0 passes ``manifest``, every member gets it back.

    The main path does not need this: the controller hands receivers the
    manifest in the sync plan.
    """
    if (group.rank == 0) != (manifest is not None):
        raise ValueError("rank 0 passes the manifest; the other ranks pass None")
    with group.claim():
        link = _Link(group, "broadcast", timeout)
        length = torch.zeros(1, dtype=torch.int64, device=group.device)
        if manifest is not None:
            payload = torch.frombuffer(bytearray(json.dumps(manifest.to_dict()).encode()), dtype=torch.uint8)
            length.fill_(payload.numel())
        link.wait(link.receive(0, length), "broadcasting the manifest length")
        if manifest is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        buf = payload.to(group.device)
        link.wait(link.receive(1, buf), "broadcasting the manifest")
        if manifest is not None:
            return manifest
    return Manifest.from_dict(json.loads(bytes(buf.cpu().numpy()).decode()))


async def send_weights_async(group: TransferGroup, manifest: Manifest,
                             named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs: Any) -> SendResult:
    """:func:`send_weights` in a worker thread; cancelling the caller cancels the transfer."""
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(send_weights, group, manifest, named_tensors, cancel=cancel, **kwargs)
    except asyncio.CancelledError:
        cancel.set()
        raise


async def receive_weights_async(group: TransferGroup, manifest: Manifest,
                                **kwargs: Any) -> dict[str, torch.Tensor]:
    """:func:`receive_weights` in a worker thread; cancelling the caller cancels the transfer."""
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(receive_weights, group, manifest, cancel=cancel, **kwargs)
    except asyncio.CancelledError:
        cancel.set()
        raise
