"""The trainer's weights as the weight broadcast sees them: the seam a training backend implements.

A :class:`WeightSource` holds the model being trained and names its weights
the way the replicas' engines do (:meth:`Engine.weight_spec`): Hugging Face
parameter names, a tied parameter once under its first name (so
``lm_head.weight`` is absent when it shares ``model.embed_tokens.weight``).
Every weight state carries a ``weight_version``; versions only grow.

Who calls what:

- the training loop (later) publishes each update with :meth:`set_weights`
  (new tensors) or by changing its parameters in place inside
  ``with source.updating(version):``;
- the broadcaster takes a :meth:`snapshot` of one version for a sync, which
  stays unchanged however the loop moves on, and sends it.

:class:`TorchWeightSource` is today's backend: a transformers model built from
a replica preset (:func:`modeling.presets.build_preset_model`) or
loaded from a local Hugging Face directory. A megatron-core backend implements
the same primitives (``_load``, ``_named_tensors``, ``_write``, ``_close``)
and converts its sharded parameters to Hugging Face names in ``_named_tensors``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
from typing import Any
from collections.abc import Iterator, Mapping

import torch

from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from mesh_runtime.reasons import Reason
from modeling.model_names import is_model_directory
from weight_transfer.spec import WeightSpec


log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    """The weights of one version, frozen: nothing the training loop does changes these tensors."""

    weight_version: int
    tensors: tuple[tuple[str, torch.Tensor], ...]

    def spec(self) -> list[WeightSpec]:
        return [WeightSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in self.tensors]


class WeightSource(abc.ABC):
    """Weights of the model being trained, by Hugging Face name, with a version.

    Thread-safe: the training loop and the broadcaster may call from different
    threads. Reads that must be consistent (:meth:`snapshot`) and writes
    (:meth:`set_weights`, :meth:`updating`) take the same lock.
    """

    backend: str = ""
    """Name of the training backend, reported in GetStatus (``"torch"``, ``"megatron"``)."""

    module: Any = None
    """The trainable ``torch.nn.Module`` once loaded, where the backend trains in this process (the GRPO
    trainer trains it); None for a source whose weights come from elsewhere."""

    def __init__(self, model: str, weight_version: int = 0, *, seed: int = 0, dtype: str = "float32") -> None:
        """``seed`` and ``dtype``: the agent's ``model_seed`` and ``weight_dtype``, which a plugin built by
        ``weight_source:`` gets whether or not it uses them (kept as ``seed`` and ``dtype_name``)."""
        self.model = model
        self.seed = seed
        self.dtype_name = dtype
        self._version = weight_version
        self._lock = threading.RLock()
        self._loaded = False

    # -- what a backend implements -----------------------------------------------------------

    @abc.abstractmethod
    def _load(self) -> None:
        """Build or load the model (blocking; called once, off the event loop)."""

    @abc.abstractmethod
    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live weights by Hugging Face name, tied ones once, detached (no copy)."""

    @abc.abstractmethod
    def _write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy already checked tensors into the live weights."""

    def _close(self) -> None:
        """Release the model's memory."""

    # -- the interface -------------------------------------------------------------------------

    def load(self) -> None:
        """Load the weights (blocking). Calling it again does nothing."""
        with self._lock:
            if not self._loaded:
                self._load()
                self._loaded = True
                log.info("%s weight source: %s loaded, %d tensors, weight version %d", self.backend, self.model,
                         len(self.weight_spec()), self._version)

    def close(self) -> None:
        """Release the model; the source is unloaded afterwards. Idempotent."""
        with self._lock:
            if self._loaded:
                self._close()
                self._loaded = False

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def weight_version(self) -> int:
        """Version of the live weights."""
        return self._version

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live weights (no copy). A concurrent update may be observed half-way; use :meth:`snapshot`."""
        self._check_loaded()
        return self._named_tensors()

    def weight_spec(self) -> list[WeightSpec]:
        """``(name, dtype, shape)`` of every weight, in broadcast order: the replica engines' naming."""
        self._check_loaded()
        return [WeightSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in self._named_tensors()]

    @contextlib.contextmanager
    def updating(self, weight_version: int) -> Iterator[None]:
        """Hold off snapshots while the weights change in place; publish ``weight_version`` on success.

        A training backend wraps its optimizer step in this. If the block
        raises, the version stays where it was.
        """
        self._check_loaded()
        with self._lock:
            if weight_version <= self._version:
                raise FailedPrecondition(f"weight version {weight_version} is not newer than the current "
                                         f"{self._version}; versions only grow", reason=Reason.STALE_WEIGHT_VERSION)
            yield
            self._version = weight_version

    def set_weights(self, named_tensors: Mapping[str, torch.Tensor], weight_version: int) -> None:
        """Replace some or all weights and publish them as ``weight_version`` (greater than the current one).

        Names are checked first (a tied parameter's alias is accepted); a
        mismatch raises :class:`~mesh_runtime.errors.InvalidArgument` and
        changes nothing.
        """
        checked = self._checked(named_tensors)
        with self.updating(weight_version):
            self._write(checked)

    def _checked(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``named_tensors`` under their canonical names, once every one fits the spec; else
        :class:`~mesh_runtime.errors.InvalidArgument` naming what does not."""
        spec = {s.name: s for s in self.weight_spec()}
        problems = []
        for name, tensor in named_tensors.items():
            expected = spec.get(self._canonical_name(name))
            if expected is None:
                problems.append(f"unknown weight {name!r}")
            elif (dtype_name(tensor.dtype), tuple(tensor.shape)) != (expected.dtype, expected.shape):
                problems.append(f"{name}: {dtype_name(tensor.dtype)} {list(tensor.shape)} where the model has "
                                f"{expected.dtype} {list(expected.shape)}")
        if problems:
            raise InvalidArgument("weights do not fit the model: " + "; ".join(problems[:5]),
                                  reason=Reason.WEIGHT_MISMATCH)
        return {self._canonical_name(n): t for n, t in named_tensors.items()}

    def snapshot(self, weight_version: int = 0) -> WeightSnapshot:
        """A frozen copy of the weights of ``weight_version`` (0 = the current one).

        Only the current version exists; asking for another raises
        :class:`~mesh_runtime.errors.FailedPrecondition`. The default copies
        every tensor on its device; a backend that never writes in place may
        override this to share its tensors instead.
        """
        self._check_loaded()
        with self._lock:
            if weight_version not in (0, self._version):
                raise FailedPrecondition(f"the trainer holds weight version {self._version}, not {weight_version} "
                                         "(only the current version can be prepared)",
                                         reason=Reason.WEIGHT_VERSION_UNAVAILABLE,
                                         metadata={"current_version": self._version})
            with torch.no_grad():
                tensors = tuple((name, t.detach().clone()) for name, t in self._named_tensors())
            return WeightSnapshot(self._version, tensors)

    def _canonical_name(self, name: str) -> str:
        """The name a tied parameter's alias is published under; backends with aliases override it."""
        return name

    def _check_loaded(self) -> None:
        if not self._loaded:
            raise FailedPrecondition(f"the {self.backend} weight source has not loaded {self.model!r} yet",
                                     reason=Reason.NO_MODEL_LOADED)


class TorchWeightSource(WeightSource):
    """A transformers causal LM: a replica preset (same preset + seed = same weights) or a local HF directory."""

    backend = "torch"

    def __init__(self, model: str, *, seed: int = 0, dtype: str = "float32", device: str = "cpu",
                 weight_version: int = 0) -> None:
        super().__init__(model, weight_version, seed=seed, dtype=dtype)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self._params: dict[str, torch.nn.Parameter] = {}
        self._aliases: dict[str, str] = {}

    def _load(self) -> None:
        from modeling.versions import check_supported  # noqa: PLC0415 - imports transformers

        check_supported()   # an unsupported torch or transformers is refused before any model is built
        if is_model_directory(self.model):
            from transformers import AutoModelForCausalLM  # noqa: PLC0415 - heavy, only when loading

            module = AutoModelForCausalLM.from_pretrained(self.model, local_files_only=True, dtype=self.dtype)
        else:
            from modeling.presets import build_preset_model  # noqa: PLC0415

            module = build_preset_model(self.model, self.seed, self.dtype)
        self.module = module.to(self.device)  # type: ignore[arg-type]  # transformers' stubs type .to oddly
        first_name: dict[int, str] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            canonical = first_name.setdefault(id(param), name)
            if canonical == name:
                self._params[name] = param
            else:
                self._aliases[name] = canonical

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._params.items():
            yield name, param.detach()

    def _write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                self._params[name].copy_(tensor)

    def _canonical_name(self, name: str) -> str:
        return self._aliases.get(name, name)

    def _close(self) -> None:
        self.module = None
        self._params.clear()
        self._aliases.clear()


def load_source_class(path: str) -> type[WeightSource]:
    """The :class:`WeightSource` subclass named ``package.module:Class``."""
    import importlib  # noqa: PLC0415

    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"{path[:100]!r} is not package.module:Class")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, WeightSource)):
        raise TypeError(f"{path[:100]!r} is not a WeightSource subclass")
    return cls
