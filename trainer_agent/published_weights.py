"""Weight sources fed by a trainer process of the user's: the broadcast sends what the trainer hands over.

This is the plugin seam for custom trainers (``weight_source:`` in the
trainer agent's config names any :class:`~trainer_agent.weight_source.WeightSource`
subclass by import path, ``package.module:Class``, built with ``model``,
``weight_version`` and the ``weight_source_options``). A backend implements
``_load`` (build the initial weights), ``_named_tensors`` (yield the live
weights by Hugging Face name, tied ones once) and ``_write`` (take checked
tensors); the base class checks names, shapes and dtypes against the spec and
versions, and snapshots a version for each broadcast.

:class:`HandedWeightSource` holds what a trainer in the same process hands over
(:meth:`~HandedWeightSource.hand_over`: tensors the trainer will not write into
again, taken without a copy): a trainer process that serves its own weights
(:mod:`trainer_agent.in_process`, the verl plugin's rank 0) needs no file and no
second process. It loads nothing: the first hand-over brings the weights and
fixes their layout, and until then a prepare fails with ``FAILED_PRECONDITION``.

:class:`DirectoryWeightSource` reads versions the trainer writes as
``DIRECTORY/<version>.safetensors`` (write to a temporary name in the same
directory, then rename, so a half-written file is never read): asked to
broadcast version ``v``, it loads ``v.safetensors`` if it is newer than what it
holds; a version that was never written fails the sync with
``FAILED_PRECONDITION``, so a version is never attached to weights that did
not change. Its initial weights are the newest file, else the model's own
(the preset or directory the replicas serve).

Both replace tensors and never write into one, so a snapshot shares them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason
from weight_transfer.published import publish, published_versions, read_published

from .weight_source import TorchWeightSource, WeightSnapshot, WeightSource

__all__ = ["DirectoryWeightSource", "HandedWeightSource", "publish"]   # publish: the client library's

log = logging.getLogger(__name__)


class HandedWeightSource(WeightSource):
    """The weights a trainer in this process hands over (see the module docstring)."""

    backend = "handed"

    def __init__(self, model: str = "", *, weight_version: int = 0, **_: object) -> None:
        super().__init__(model or "the trainer's model", weight_version)
        self._tensors: dict[str, torch.Tensor] = {}

    def load(self) -> None:
        """Nothing to load: the first :meth:`hand_over` brings the weights."""

    def _load(self) -> None:
        """Never called (see :meth:`load`)."""

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()

    def _write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors.update({n: t.detach().clone() for n, t in named_tensors.items()})

    def hand_over(self, named_tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Take ``named_tensors`` as version ``weight_version``, without a copy: the caller never writes into them
        again. The first hand-over fixes the names, shapes and dtypes; a later one must fit them (a mismatch
        raises :class:`~mesh_runtime.errors.InvalidArgument`) and be a newer version
        (:class:`~mesh_runtime.errors.FailedPrecondition`); either way nothing changes."""
        tensors = {n: t.detach() for n, t in named_tensors.items()}
        with self._lock:
            if not self._loaded:
                if not tensors:
                    raise InvalidArgument("the first hand-over holds no tensor: it fixes the model's layout",
                                          reason=Reason.WEIGHT_MISMATCH)
                self._tensors, self._version, self._loaded = tensors, weight_version, True
                log.info("weights handed over: %d tensors, weight version %d", len(tensors), weight_version)
                return
            checked = self._checked(tensors)
            with self.updating(weight_version):
                self._tensors.update(checked)

    def snapshot(self, weight_version: int = 0) -> WeightSnapshot:
        """The current tensors themselves (no copy: they are replaced, never written into)."""
        self._check_loaded()
        with self._lock:
            if weight_version not in (0, self._version):
                return super().snapshot(weight_version)   # raises, naming the version held
            return WeightSnapshot(self._version, tuple(self._tensors.items()))


class DirectoryWeightSource(HandedWeightSource):
    """Versions published as ``DIRECTORY/<version>.safetensors`` (see the module docstring)."""

    backend = "directory"
    load = WeightSource.load   # its initial weights are the newest file's, else the model's own

    def __init__(self, model: str, *, directory: str, weight_version: int = 0, seed: int = 0,
                 dtype: str = "float32", **_: object) -> None:
        super().__init__(model, weight_version=weight_version)
        self.directory = Path(directory)
        self._seed, self._dtype = seed, dtype

    def _read(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s tensors over a mapping of its file (no copy: see :func:`read_published`)."""
        return read_published(self.directory / f"{version}.safetensors")

    def _load(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        initial = TorchWeightSource(self.model, seed=self._seed, dtype=self._dtype)
        initial.load()
        self._tensors = {name: tensor.clone() for name, tensor in initial.named_weights()}
        initial.close()
        versions = [v for v in published_versions(self.directory) if v > self._version]
        if versions:
            self._tensors.update(self._read(versions[-1]))
            self._version = versions[-1]

    def snapshot(self, weight_version: int = 0) -> WeightSnapshot:
        """Load ``weight_version`` if it is newer and published, then share the current tensors."""
        self._check_loaded()
        with self._lock:
            if weight_version > self._version and weight_version in published_versions(self.directory):
                self.hand_over(self._read(weight_version), weight_version)
            return super().snapshot(weight_version)
