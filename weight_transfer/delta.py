"""Delta versions: a weight version sent as what changed since a version the receivers hold.

In an RL step at a typical learning rate most elements of a bf16 model do not
change: an update smaller than half a unit in the last place rounds back to
the same value. So instead of the whole stream, the sender can send, per
bucket of the target version's stream (:mod:`.manifest`), only the words that
differ from the *base* version the receivers already serve.

Encoding
--------
Each bucket of the target stream is compared with the same bucket of the base
stream as 16-bit words (8-bit for a bucket of odd length). The delta is itself
a stream of named tensors, laid out and sent like any weights (so it travels
through :func:`~.transfer.send_weights` with its chain or broadcast topology,
its checksum, its manifest tag and bucket digests), with, per bucket ``k``:

- nothing, when the bucket did not change;
- ``k/i`` (int32 word indices, strictly increasing) or ``k/m`` (a bitmap,
  one bit per word), whichever is smaller, followed by ``k/v`` (the new
  words), when that is at most ``bucket_ratio`` of the bucket's bytes;
- ``k/f`` (the bucket's bytes, uint8), otherwise.

In bf16, indices cost 6 bytes per changed element and a bitmap 1/8 of a
byte per element plus 2 per changed one; they break even at 3.1% of the
elements changed, so a bucket at 2% costs 6% of its bytes and one at 4% 10%.
With the default ``bucket_ratio`` of 0.5 a bucket goes whole once a bitmap
and its words reach half its bytes (about 44% changed), because scattering
words also costs the receiver time. The whole delta is offered
only when it is at most ``max_ratio`` of the full stream
(``weight_transfer.delta_max_ratio``); otherwise a full copy is cheaper.

Composing
---------
Consecutive deltas (``v -> v+1 -> ... -> n``) compose into one from ``v``
(:func:`compose_deltas`): per bucket the words any of them changed, their
values read from version ``n``, a bucket one of them sent whole sent whole.
A replica that missed versions takes it instead of a full copy.

Receiving
---------
A receiver whose engine lends its weights applies the delta where they lie
(:mod:`.delta_in_place`); any other packs the weights it serves into the
target layout (base and target versions of one model have the same layout),
applies the delta (:func:`apply_delta`) and loads the result. Either way the
result is checked against the target manifest: its checksum, or with a sync
key every BLAKE3 bucket digest. A delta that is malformed, out of order or
applied to other bytes fails the check and is refused; the replica keeps
serving its old weights, and only then are they compared with the base
version's checksum, to tell a replica that needs a full copy from a bad
delta.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from .errors import ChecksumMismatch, InvalidManifest, NotAuthentic
from .manifest import Manifest, StreamHasher, bucket_digest, build_manifest
from .transfer import StreamPacker

DEFAULT_BUCKET_RATIO = 0.5
"""A bucket goes sparse when its indices and values take at most this share of its bytes."""

_INDEX = torch.int32
_KINDS = ("i", "m", "v", "f")
_SHIFTS = torch.arange(8, dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class DeltaStats:
    """What a delta holds, for metrics and the step record."""

    changed_words: int
    total_words: int
    sparse_buckets: int
    full_buckets: int
    unchanged_buckets: int
    bytes: int
    """Bytes of the delta stream (what travels)."""
    full_bytes: int
    """Bytes of the target stream (what a full copy sends)."""

    @property
    def density(self) -> float:
        """Share of the target's words that changed."""
        return self.changed_words / self.total_words if self.total_words else 0.0

    @property
    def ratio(self) -> float:
        """Delta bytes over full bytes."""
        return self.bytes / self.full_bytes if self.full_bytes else 0.0


@dataclasses.dataclass(frozen=True)
class Delta:
    """A target version as a difference from ``base_version``."""

    base_version: int
    base_checksum: str
    """Checksum of the base version's stream, in the target manifest's algorithm and layout."""
    manifest: Manifest
    """The delta stream's manifest (what the sender sends and the receivers receive)."""
    tensors: tuple[tuple[str, torch.Tensor], ...]
    stats: DeltaStats


def word_dtype(start: int, stop: int) -> torch.dtype:
    """The unit a bucket is compared in: 16-bit words where the bucket's start and length allow."""
    return torch.int16 if start % 2 == 0 and stop % 2 == 0 else torch.uint8


def pack_stream(manifest: Manifest, named_tensors: Iterable[tuple[str, torch.Tensor]],
                out: torch.Tensor | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The whole stream ``manifest`` describes, as one uint8 tensor (``out`` or a new one on ``device``).

    ``named_tensors`` in manifest order; :class:`~.errors.ManifestMismatch` if they differ from it.
    """
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device) if out is None else out
    packer = StreamPacker(manifest, named_tensors)
    if manifest.total_bytes:
        packer.fill(flat[:manifest.total_bytes], 0)
    packer.finish()
    return flat


def stream_checksum(manifest: Manifest, flat: torch.Tensor) -> str:
    """Checksum of the stream in ``flat``, in ``manifest``'s algorithm (fed bucket by bucket)."""
    hasher = StreamHasher(manifest.checksum_algorithm)
    for index in range(manifest.num_buckets):
        start, stop = manifest.bucket_range(index)
        hasher.update(flat[start:stop])
    return hasher.hexdigest()


def check_stream(manifest: Manifest, flat: torch.Tensor, *, key: bytes = b"") -> None:
    """Check a rebuilt stream against ``manifest``: every BLAKE3 bucket digest with a ``key``, else the checksum.

    Raises :class:`~.errors.NotAuthentic` or :class:`~.errors.ChecksumMismatch`.
    """
    if key:
        check_digests(manifest, (bucket_digest(flat[start:stop])
                                 for start, stop in map(manifest.bucket_range, range(manifest.num_buckets))))
        return
    got = stream_checksum(manifest, flat)
    if got != manifest.checksum:
        raise ChecksumMismatch(manifest.checksum, got, manifest.checksum_algorithm)


def check_digests(manifest: Manifest, digests: Iterable[str]) -> None:
    """Compare rebuilt weights' BLAKE3 bucket digests (in bucket order, read one at a time) with ``manifest``'s;
    :class:`~.errors.NotAuthentic` at the first that differs."""
    if len(manifest.bucket_digests) != manifest.num_buckets:
        raise NotAuthentic("weights not authentic: the target manifest has no bucket digests to check the "
                           "rebuilt weights against")
    checked = 0
    for index, digest in enumerate(digests):
        if index >= manifest.num_buckets or digest != manifest.bucket_digests[index]:
            raise NotAuthentic(f"weights not authentic: bucket {index} of {manifest.num_buckets} of the weights "
                               "rebuilt from the delta does not match its BLAKE3 digest in the manifest")
        checked += 1
    if checked != manifest.num_buckets:
        raise NotAuthentic(f"weights not authentic: the rebuilt weights have {checked} buckets, the manifest "
                           f"{manifest.num_buckets}")


def same_layout(a: Manifest, b: Manifest) -> bool:
    """Whether two versions' streams are laid out alike (so one can be a delta base of the other)."""
    return (a.tensors, a.bucket_size_bytes, a.total_bytes, a.checksum_algorithm) == (
        b.tensors, b.bucket_size_bytes, b.total_bytes, b.checksum_algorithm)


def encode_delta(base: Manifest, base_tensors: Iterable[tuple[str, torch.Tensor]], target: Manifest,
                 target_tensors: Iterable[tuple[str, torch.Tensor]], *, base_version: int,
                 bucket_ratio: float = DEFAULT_BUCKET_RATIO, max_ratio: float = 1.0,
                 device: torch.device | str = "cpu") -> Delta | None:
    """The delta that turns the ``base`` stream into the ``target`` stream (tensors in manifest order, on
    ``device``), or None once it would exceed ``max_ratio`` of the full stream (a full copy is cheaper).

    Raises ``ValueError`` when the two layouts differ (a delta needs the same
    tensors, bucket size and checksum algorithm).
    """
    if not same_layout(base, target):
        raise ValueError("the base and target versions are laid out differently; a delta needs the same "
                         "tensors, bucket size and checksum algorithm")
    if not 0 < bucket_ratio <= 1:
        raise ValueError(f"bucket_ratio must be in (0, 1], got {bucket_ratio}")
    device = torch.device(device)
    old_packer, new_packer = StreamPacker(base, base_tensors), StreamPacker(target, target_tensors)
    scratch = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
    tensors: list[tuple[str, torch.Tensor]] = []
    changed = total = sparse = full = unchanged = size = 0
    budget = max_ratio * target.total_bytes
    for index in range(target.num_buckets):
        start, stop = target.bucket_range(index)
        old, new = (_bucket(packer, start, stop, scratch, which, device)
                    for which, packer in enumerate((old_packer, new_packer)))
        word = word_dtype(start, stop)
        words = new.view(word)
        total += words.numel()
        differs = _differs(old.view(word), words)
        count = _count(differs)   # counted first: a dense bucket never lists its positions
        changed += count
        if count == 0:
            unchanged += 1
        else:
            entries, cost = _entries(index, new, words, count, lambda: _where(differs), bucket_ratio,
                                     device)
            tensors += entries
            sparse += len(entries) > 1
            full += len(entries) == 1
            size += cost
        if size > budget:
            return None
    old_packer.finish()
    new_packer.finish()
    manifest = build_manifest(tensors, target.bucket_size_bytes, checksum_algorithm=target.checksum_algorithm)
    stats = DeltaStats(changed_words=changed, total_words=total, sparse_buckets=sparse, full_buckets=full,
                       unchanged_buckets=unchanged, bytes=manifest.total_bytes, full_bytes=target.total_bytes)
    return Delta(base_version, base.checksum, manifest, tuple(tensors), stats)


def compose_deltas(deltas: list[Delta], target: Manifest, target_tensors: Iterable[tuple[str, torch.Tensor]], *,
                   bucket_ratio: float = DEFAULT_BUCKET_RATIO, max_ratio: float = 1.0,
                   device: torch.device | str = "cpu") -> Delta | None:
    """One delta from the first one's base to ``target``, from consecutive ``deltas`` (each one's target the
    next one's base, the last one's the ``target`` stream given): per bucket the words any of them changed,
    with their values in ``target``; a bucket one of them sent whole goes whole. None once it would exceed
    ``max_ratio`` of the full stream. A replica that missed versions catches up with it, bit for bit the
    target (checked as any delta is).

    Raises ``ValueError`` without deltas or when a delta's layout differs from ``target``'s.
    """
    if not deltas:
        raise ValueError("composing needs at least one delta")
    device = torch.device(device)
    changed: dict[int, list[torch.Tensor] | None] = {}      # bucket -> positions from each delta, None: whole
    for delta in deltas:
        tensors = dict(delta.tensors)
        for bucket, kind in delta_entries(delta.manifest, target):
            if kind == "f":
                changed[bucket] = None
            elif kind in "im":
                parts = changed.setdefault(bucket, [])
                if parts is not None:
                    marks = tensors[f"{bucket}/{kind}"].to(device)
                    start, stop = target.bucket_range(bucket)
                    count = (stop - start) // word_dtype(start, stop).itemsize
                    parts.append(marks.to(torch.int64) if kind == "i" else unpack_bits(marks, count))
    packer = StreamPacker(target, target_tensors)
    scratch = [torch.empty(0, dtype=torch.uint8, device=device)]
    tensors_out: list[tuple[str, torch.Tensor]] = []
    count_all = sparse = full = size = 0
    budget = max_ratio * target.total_bytes
    for bucket in range(target.num_buckets):
        start, stop = target.bucket_range(bucket)
        new = _bucket(packer, start, stop, scratch, 0, device)   # every bucket, in order: the packer reads on
        if bucket not in changed:
            continue
        word = word_dtype(start, stop)
        words = new.view(word)
        positions = changed[bucket]
        where = torch.unique(torch.cat(positions)) if positions is not None else None   # sorted, each once
        count = words.numel() if where is None else where.numel()
        count_all += count
        entries, cost = _entries(bucket, new, words, count, None if where is None else lambda: where, bucket_ratio,
                                 device)
        tensors_out += entries
        sparse += len(entries) > 1
        full += len(entries) == 1
        size += cost
        if size > budget:
            return None
    packer.finish()
    manifest = build_manifest(tensors_out, target.bucket_size_bytes, checksum_algorithm=target.checksum_algorithm)
    total = sum((stop - start) // word_dtype(start, stop).itemsize
                for start, stop in map(target.bucket_range, range(target.num_buckets)))
    stats = DeltaStats(changed_words=count_all, total_words=total, sparse_buckets=sparse, full_buckets=full,
                       unchanged_buckets=target.num_buckets - sparse - full, bytes=manifest.total_bytes,
                       full_bytes=target.total_bytes)
    first = deltas[0]
    return Delta(first.base_version, first.base_checksum, manifest, tuple(tensors_out), stats)


def _entries(bucket: int, new: torch.Tensor, words: torch.Tensor, count: int,
             where: Callable[[], torch.Tensor] | None, bucket_ratio: float,
             device: torch.device) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """A changed bucket's entries in a delta and their bytes: its ``count`` changed words (at ``where()``, asked
    only when they go sparse; None: send it whole) with their indices or bitmap, or the whole bucket once
    that would take more than ``bucket_ratio`` of its bytes."""
    kind, cost = _cheapest(count, words.numel(), words.element_size())
    if where is None or cost > bucket_ratio * new.numel():
        return [(f"{bucket}/f", new.clone())], new.numel()
    at = where()
    marks = at.to(_INDEX) if kind == "i" else _pack_bits(at, words.numel(), device)
    return [(f"{bucket}/{kind}", marks), (f"{bucket}/v", words[at])], cost


def _cheapest(count: int, words: int, word_size: int) -> tuple[str, int]:
    """The cheaper way to say which of ``words`` words changed: indices (``i``) or a bitmap (``m``), and its
    bytes with the new words."""
    by_index = count * (_INDEX.itemsize + word_size)
    by_bitmap = -(-words // 8) + count * word_size
    return ("i", by_index) if by_index <= by_bitmap else ("m", by_bitmap)


# On the CPU numpy compares, counts and lists 16-bit words several times faster than torch does (measured on
# 32 MB buckets: 2.3 ms against 14 ms to compare, 3.0 against 10.7 to list), so host buffers go through it; a
# device's go through torch, on the device.

def _differs(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Where two equally long 1-D word tensors differ (bool)."""
    if old.device.type == "cpu":
        return torch.from_numpy(np.not_equal(old.detach().numpy(), new.detach().numpy()))
    return torch.ne(old, new)


def _count(mask: torch.Tensor) -> int:
    return int(np.count_nonzero(mask.numpy())) if mask.device.type == "cpu" else int(torch.count_nonzero(mask))


def _where(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the set elements of a 1-D bool tensor, increasing (int64)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().flatten()


def _pack_bits(where: torch.Tensor, words: int, device: torch.device) -> torch.Tensor:
    """Bitmap of ``words`` bits (bit ``j % 8`` of byte ``j // 8``) with the bits at ``where`` set."""
    if device.type == "cpu":
        flags = np.zeros(words, dtype=np.bool_)
        flags[where.numpy()] = True
        return torch.from_numpy(np.packbits(flags, bitorder="little"))
    bits = torch.zeros(-(-words // 8) * 8, dtype=torch.uint8, device=device)
    bits[where] = 1
    return (bits.view(-1, 8) << _SHIFTS.to(device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, words: int) -> torch.Tensor:
    """Positions of the set bits among the first ``words`` bits of ``bitmap``, increasing."""
    if bitmap.device.type == "cpu":
        flags = np.unpackbits(bitmap.contiguous().numpy(), count=words, bitorder="little")
        return torch.from_numpy(np.flatnonzero(flags))
    bits = (bitmap.view(-1, 1) >> _SHIFTS.to(bitmap.device)) & 1
    return bits.view(-1)[:words].nonzero().flatten()


def _bucket(packer: StreamPacker, start: int, stop: int, scratch: list[torch.Tensor], which: int,
            device: torch.device) -> torch.Tensor:
    """Stream bytes ``[start, stop)`` from ``packer``: a view of one tensor where they lie in one, else packed
    into ``scratch[which]`` (valid until the next call)."""
    view = packer.direct_view(start, stop, device)
    if view is not None:
        return view
    if scratch[which].numel() < stop - start:
        scratch[which] = torch.empty(stop - start, dtype=torch.uint8, device=device)
    buf = scratch[which][:stop - start]
    packer.fill(buf, start)
    return buf


def delta_entries(delta_manifest: Manifest, target: Manifest) -> list[tuple[int, str]]:
    """Check a delta stream's entries against the target and return ``(bucket, kind)`` of each, in order.

    Per bucket, in increasing bucket order, a delta holds ``f`` alone, or ``i``
    or ``m`` followed by ``v``. Raises :class:`~.errors.InvalidManifest` for an
    entry that names no bucket of the target, another kind, buckets out of
    order or repeated, or a dtype or shape that cannot be one.
    """
    out: list[tuple[int, str]] = []
    entries = delta_manifest.tensors
    for position, entry in enumerate(entries):
        bucket_text, _, kind = entry.name.partition("/")
        if not bucket_text.isdigit() or kind not in _KINDS:
            raise InvalidManifest(f"delta entry {entry.name[:40]!r} is not BUCKET/i, BUCKET/m, BUCKET/v or "
                                  "BUCKET/f")
        bucket = int(bucket_text)
        if bucket >= target.num_buckets:
            raise InvalidManifest(f"delta entry {entry.name[:40]!r} names bucket {bucket}; the target has "
                                  f"{target.num_buckets}")
        opens = kind != "v"
        after_marks = bool(out) and out[-1][0] == bucket and out[-1][1] in ("i", "m")
        if (opens and out and bucket <= out[-1][0]) or (not opens and not after_marks):
            raise InvalidManifest(f"delta entry {entry.name[:40]!r} is out of order, repeats its bucket or has "
                                  "no indices before it")
        start, stop = target.bucket_range(bucket)
        word = word_dtype(start, stop)
        words = (stop - start) // word.itemsize
        if kind == "f" and (entry.dtype, entry.shape) != ("uint8", (stop - start,)):
            raise InvalidManifest(f"delta entry {entry.name!r} must be uint8 [{stop - start}]")
        if kind == "m" and (entry.dtype, entry.shape) != ("uint8", (-(-words // 8),)):
            raise InvalidManifest(f"delta entry {entry.name!r} must be uint8 [{-(-words // 8)}]")
        if kind == "i" and (entry.dtype != "int32" or len(entry.shape) != 1):
            raise InvalidManifest(f"delta entry {entry.name!r} must be 1-D int32")
        if kind in "im":
            follow = entries[position + 1] if position + 1 < len(entries) else None
            if follow is None or follow.name != f"{bucket}/v":
                raise InvalidManifest(f"delta entry {entry.name!r} must be followed by {bucket}/v")
            word_name = str(word).removeprefix("torch.")
            if follow.dtype != word_name or len(follow.shape) != 1 or (kind == "i" and follow.shape != entry.shape):
                raise InvalidManifest(f"delta entry {follow.name!r} must be 1-D {word_name}"
                                      + (f" [{entry.shape[0]}], like its indices" if kind == "i" else ""))
        out.append((bucket, kind))
    return out


def apply_delta(target: Manifest, flat: torch.Tensor, delta_manifest: Manifest,
                delta_tensors: Mapping[str, torch.Tensor]) -> None:
    """Turn the base stream in ``flat`` into the target's, in place.

    ``flat`` must hold the base stream (:func:`pack_stream` and a checksum
    check); the result still needs :func:`check_stream`. Raises
    :class:`~.errors.InvalidManifest` for a malformed delta (see
    :func:`delta_entries`) or indices that are out of range or not strictly
    increasing; ``flat`` may then be half-changed, so callers apply deltas to
    a copy of what they serve.
    """
    for bucket, kind in delta_entries(delta_manifest, target):
        start, stop = target.bucket_range(bucket)
        if kind == "f":
            flat[start:stop].copy_(delta_tensors[f"{bucket}/f"])
        elif kind == "i":
            indices = delta_tensors[f"{bucket}/i"].to(torch.int64)
            words = flat[start:stop].view(word_dtype(start, stop))
            if indices.numel() and (int(indices[0]) < 0 or int(indices[-1]) >= words.numel()
                                    or not bool((indices[1:] > indices[:-1]).all())):
                raise InvalidManifest(f"delta indices of bucket {bucket} are out of range or not strictly "
                                      "increasing")
            words[indices] = delta_tensors[f"{bucket}/v"].to(words.device)
        elif kind == "m":
            words = flat[start:stop].view(word_dtype(start, stop))
            indices = unpack_bits(delta_tensors[f"{bucket}/m"].to(words.device), words.numel())
            values = delta_tensors[f"{bucket}/v"]
            if indices.numel() != values.numel():
                raise InvalidManifest(f"the bitmap of bucket {bucket} marks {indices.numel()} words but "
                                      f"{values.numel()} values follow it")
            words[indices] = values.to(words.device)
