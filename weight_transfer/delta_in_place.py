"""A delta applied to the tensors a replica serves, in place, checked, and undone when it fails.

:func:`~.delta.apply_delta` rebuilds the target in a packed copy of the
served weights, which the engine then loads: two passes over the model (pack,
load) and one more model's memory on the weights' device, for a delta that
touches a fraction of a percent of the words. An engine that lends its live
tensors (the torch engine, while it runs no step) takes the delta directly:

1. the changed words of each bucket are mapped from stream positions to the
   tensors they fall in (tensors start 64-byte aligned; the bytes between
   them are padding, which no delta may change) and written there, each old
   value kept first; a bucket sent whole is copied range by range;
2. the tensors themselves are hashed in the target's layout, padding as
   zeros, and compared with the target manifest: every BLAKE3 bucket digest
   with a sync key, else the checksum (:func:`check_tensors`);
3. anything failing on the way (a malformed delta, indices out of order, a
   result that does not match) restores every changed byte from what was
   kept, so the old version serves on, bit for bit, and raises.

What it costs is the hash of the result (the check both ways share) and, per
changed word, a gather and a scatter.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from .delta import check_digests, delta_entries, unpack_bits, word_dtype
from .errors import ChecksumMismatch, InvalidManifest, ManifestMismatch
from .manifest import BucketDigests, Manifest, StreamHasher, TensorEntry, dtype_name, lay_out


def check_tensors(manifest: Manifest, named_tensors: Iterable[tuple[str, torch.Tensor]], *, key: bytes = b"") -> None:
    """Check tensors (in manifest order) against ``manifest`` as :func:`~.delta.check_stream` checks a packed
    stream, hashing the tensors where they lie (padding as zeros): every BLAKE3 bucket digest with a ``key``,
    else the checksum. Raises :class:`~.errors.ManifestMismatch` when they are laid out otherwise,
    :class:`~.errors.NotAuthentic` or :class:`~.errors.ChecksumMismatch`."""
    hasher = BucketDigests(manifest.bucket_size_bytes) if key else StreamHasher(manifest.checksum_algorithm)
    entries, total = lay_out(named_tensors, manifest.bucket_size_bytes, hasher.update)
    if (entries, total) != (manifest.tensors, manifest.total_bytes):
        raise ManifestMismatch("the tensors checked are not laid out as the target manifest")
    if isinstance(hasher, BucketDigests):
        check_digests(manifest, hasher.finish())
    elif (got := hasher.hexdigest()) != manifest.checksum:
        raise ChecksumMismatch(manifest.checksum, got, manifest.checksum_algorithm)


class _Served:
    """The served tensors as byte ranges of the target's stream, and the undo log of what was written."""

    def __init__(self, target: Manifest, named_tensors: Mapping[str, torch.Tensor]) -> None:
        if set(named_tensors) != {e.name for e in target.tensors}:
            raise ManifestMismatch("the served tensors are not the ones the delta's target lists")
        self.ordered: list[tuple[str, torch.Tensor]] = []
        self.starts: list[int] = []
        self.stops: list[int] = []
        self.bytes: list[torch.Tensor] = []
        for entry in target.tensors:
            tensor = named_tensors[entry.name]
            _check_fits(entry, tensor)
            self.ordered.append((entry.name, tensor))
            if entry.nbytes:
                self.starts.append(target.stream_offset(entry))
                self.stops.append(self.starts[-1] + entry.nbytes)
                self.bytes.append(tensor.detach().reshape(-1).view(torch.uint8))
        self.device = self.bytes[0].device if self.bytes else torch.device("cpu")
        self._starts = np.array(self.starts, dtype=np.int64)
        self._stops = np.array(self.stops, dtype=np.int64)
        self.undo: list[Callable[[], object]] = []

    def copy(self, start: int, data: torch.Tensor) -> None:
        """Write stream bytes ``[start, start + len(data))`` (a bucket sent whole); its padding must be zeros."""
        stop = start + data.numel()
        data = data.to(self.device)
        cursor = start
        for k in range(bisect.bisect_right(self.stops, start), len(self.starts)):   # the first ending after start
            if self.starts[k] >= stop:
                break
            lo, hi = max(start, self.starts[k]), min(stop, self.stops[k])
            self._zeros(data, cursor - start, lo - start)
            target = self.bytes[k][lo - self.starts[k]:hi - self.starts[k]]
            kept = target.clone()
            self.undo.append(functools.partial(target.copy_, kept))
            target.copy_(data[lo - start:hi - start])
            cursor = hi
        self._zeros(data, cursor - start, stop - start)

    def scatter(self, start: int, words: torch.Tensor, values: torch.Tensor, word: torch.dtype) -> None:
        """Write ``values`` at word positions ``words`` (increasing) of the bucket starting at ``start``.

        The positions are routed to their tensors on the host (they are few: the changed words), with numpy,
        whose small operations cost a fraction of torch's; host tensors are written through numpy too."""
        size = word.itemsize
        at = words.cpu().numpy().astype(np.int64) * size + start
        raw = values.cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
        if size > 1:   # every byte of a word: one of them may be the last of a tensor, the next padding
            at = (at[:, None] + np.arange(size)).reshape(-1)
        which = np.searchsorted(self._starts, at, side="right") - 1
        inside = (which >= 0) & (at < self._stops[np.maximum(which, 0)])
        if not inside.all():   # a word's other byte may be padding; it stays zero
            if raw[~inside].any():
                raise InvalidManifest(f"the delta writes non-zero padding between tensors in the bucket at stream "
                                      f"byte {start}")
            at, raw, which = at[inside], raw[inside], which[inside]
        if not at.size:
            return
        cuts = (np.flatnonzero(np.diff(which)) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, at.size]):
            k = int(which[lo])
            self._put(self.bytes[k], at[lo:hi] - self.starts[k], raw[lo:hi])

    def _put(self, target: torch.Tensor, local: np.ndarray, new: np.ndarray) -> None:
        if target.device.type == "cpu":
            host = target.numpy()
            self.undo.append(functools.partial(np.put, host, local, host[local]))
            host[local] = new
            return
        index = torch.from_numpy(local).to(target.device)
        self.undo.append(functools.partial(target.index_put_, (index,), target[index]))
        target[index] = torch.from_numpy(new).to(target.device)

    def restore(self) -> None:
        for step in reversed(self.undo):
            step()
        self.undo.clear()

    @staticmethod
    def _zeros(data: torch.Tensor, lo: int, hi: int) -> None:
        if hi > lo and bool(data[lo:hi].any()):
            raise InvalidManifest("a whole bucket of the delta has non-zero padding between tensors")


def _check_fits(entry: TensorEntry, tensor: torch.Tensor) -> None:
    if dtype_name(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise ManifestMismatch(f"served tensor {entry.name!r} is {dtype_name(tensor.dtype)} "
                               f"{list(tensor.shape)}; the delta's target has {entry.dtype} {list(entry.shape)}",
                               tensor_name=entry.name)
    if not tensor.is_contiguous():
        raise ManifestMismatch(f"served tensor {entry.name!r} is not contiguous; it cannot take a delta in place",
                               tensor_name=entry.name)


def apply_delta_in_place(target: Manifest, named_tensors: Iterable[tuple[str, torch.Tensor]],
                         delta_manifest: Manifest, delta_tensors: Mapping[str, torch.Tensor], *,
                         key: bytes = b"") -> None:
    """Turn the served tensors, which hold the base version, into ``target``'s, and check them against it.

    Raises, with every tensor restored bit for bit: :class:`~.errors.ManifestMismatch` when the tensors are
    not the target's (names, dtypes, shapes, contiguous), :class:`~.errors.InvalidManifest` for a malformed
    delta (as :func:`~.delta.apply_delta`, and one that writes padding), :class:`~.errors.NotAuthentic` or
    :class:`~.errors.ChecksumMismatch` when the result is not the target (a wrong base, or a delta that was
    not the one for it).
    """
    served = _Served(target, dict(named_tensors))
    try:
        for bucket, kind in delta_entries(delta_manifest, target):
            start, stop = target.bucket_range(bucket)
            if kind == "f":
                served.copy(start, delta_tensors[f"{bucket}/f"])
            elif kind in ("i", "m"):
                word = word_dtype(start, stop)
                count = (stop - start) // word.itemsize
                values = delta_tensors[f"{bucket}/v"]
                words = _positions(bucket, kind, delta_tensors[f"{bucket}/{kind}"], count, values)
                served.scatter(start, words, values, word)
        check_tensors(target, served.ordered, key=key)
    except BaseException:
        served.restore()
        raise


def _positions(bucket: int, kind: str, marks: torch.Tensor, count: int, values: torch.Tensor) -> torch.Tensor:
    """The word positions a bucket's indices (``i``) or bitmap (``m``) name, checked against its ``count`` words
    and its values."""
    if kind == "i":
        words = marks.to(torch.int64)
        if words.numel() and (int(words[0]) < 0 or int(words[-1]) >= count
                              or not bool((words[1:] > words[:-1]).all())):
            raise InvalidManifest(f"delta indices of bucket {bucket} are out of range or not strictly increasing")
    else:
        words = unpack_bits(marks, count)
    if words.numel() != values.numel():
        raise InvalidManifest(f"the {'indices' if kind == 'i' else 'bitmap'} of bucket {bucket} mark "
                              f"{words.numel()} words but {values.numel()} values follow")
    return words
