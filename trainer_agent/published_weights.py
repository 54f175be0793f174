"""A weight source fed by a trainer process of the user's: the trainer agent broadcasts what it publishes.

This is the plugin seam for custom trainers (``weight_source:`` in the
trainer agent's config names any :class:`~trainer_agent.weight_source.WeightSource`
subclass by import path, ``package.module:Class``, built with ``model``,
``weight_version`` and the ``weight_source_options``). A backend implements
``_load`` (build the initial weights), ``_named_tensors`` (yield the live
weights by Hugging Face name, tied ones once) and ``_write`` (take checked
tensors); the base class checks names, shapes and dtypes against the spec and
versions, and snapshots a version for each broadcast.

:class:`DirectoryWeightSource`, the one shipped, reads versions the trainer
writes as ``DIRECTORY/<version>.safetensors`` (write to a temporary name in the
same directory, then rename, so a half-written file is never read): asked to
broadcast version ``v``, it loads ``v.safetensors`` if it is newer than what it
holds; a version that was never written fails the sync with
``FAILED_PRECONDITION``, so a version is never attached to weights that did
not change. Its initial weights are the newest file, else the model's own
(the preset or directory the replicas serve).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from weight_transfer.published import publish, published_versions, read_published

from .weight_source import TorchWeightSource, WeightSnapshot, WeightSource

__all__ = ["DirectoryWeightSource", "publish"]   # publish: the client library's, named here as before


class DirectoryWeightSource(WeightSource):
    """Versions published as ``DIRECTORY/<version>.safetensors`` (see the module docstring)."""

    backend = "directory"

    def __init__(self, model: str, *, directory: str, weight_version: int = 0, seed: int = 0,
                 dtype: str = "float32", **_: object) -> None:
        super().__init__(model, weight_version)
        self.directory = Path(directory)
        self._seed, self._dtype = seed, dtype
        self._tensors: dict[str, torch.Tensor] = {}

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

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()

    def _write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors.update({n: t.detach().clone() for n, t in named_tensors.items()})

    def snapshot(self, weight_version: int = 0) -> WeightSnapshot:
        """Load ``weight_version`` if it is newer and published, then the current tensors themselves: this source
        replaces tensors and never writes into one, so a snapshot shares them (no copy)."""
        self._check_loaded()
        with self._lock:
            if weight_version > self._version and weight_version in published_versions(self.directory):
                self._take(self._read(weight_version), weight_version)
            if weight_version not in (0, self._version):
                return super().snapshot(weight_version)   # raises, naming the version held
            return WeightSnapshot(self._version, tuple(self._tensors.items()))

    def _take(self, named_tensors: dict[str, torch.Tensor], weight_version: int) -> None:
        """:meth:`set_weights` without its copy: the tensors were read for this source alone."""
        named_tensors = self._checked(named_tensors)
        with self.updating(weight_version):
            self._tensors.update({n: t.detach() for n, t in named_tensors.items()})
