"""The Hugging Face view of the weights an out-of-process engine serves (vLLM, SGLang).

vLLM and SGLang hold the weights in their worker processes, fused
(``qkv_proj``, ``gate_up_proj``) and sharded over tensor-parallel ranks, so
they cannot be read back under the names a trainer uses.
:class:`WeightCatalog` keeps that view on the agent's side instead:

* the spec (names and shapes) comes from the checkpoint's safetensors
  headers, with floating-point dtypes replaced by the dtype vLLM serves
  (``model_config.dtype``): the engines' weight loaders copy into parameters of
  that dtype, so the catalog asks trainers for exactly it;
* the current tensors are the ones installed by ``load_weights`` (kept by
  reference, no copy) over the checkpoint's, which are read lazily.

:func:`weight_buckets` splits an update into ``collective_rpc`` payloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .checkpoint_spec import checkpoint_spec, read_tensor
from .errors import WeightMismatch


def tensor_nbytes(tensor: Any) -> int:
    """Bytes of a torch tensor (or of anything with ``nbytes``)."""
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except AttributeError:
        return int(getattr(tensor, "nbytes", 0))


def weight_buckets(named: Iterable[tuple[str, Any]], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """Split ``(name, tensor)`` pairs into lists of at most ``limit`` bytes
    (a single larger tensor gets a bucket of its own)."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class WeightCatalog:
    """Spec, manifest checks and host-side tensors of one served model."""

    def __init__(self, model_dir: str | Path, serving_dtype: str, *, keep_tensors: bool = True) -> None:
        self.spec, self._files = checkpoint_spec(model_dir, serving_dtype)
        self._by_name = {s.name: s for s in self.spec}
        self._keep_tensors = keep_tensors
        self._installed: dict[str, Any] = {}
        self.exportable = True
        """False once an update was applied without keeping its tensors."""

    def check(self, named_tensors: Mapping[str, Any], require_complete: bool) -> None:
        """Raise :class:`WeightMismatch` unless every tensor matches its spec
        (and, if ``require_complete``, every weight is present)."""
        problems: list[str] = []
        for name, tensor in named_tensors.items():
            spec = self._by_name.get(name)
            if spec is None:
                problems.append(f"unknown weight {name!r}")
                continue
            shape, dtype = getattr(tensor, "shape", None), getattr(tensor, "dtype", None)
            if shape is None or dtype is None or getattr(tensor, "is_meta", False):
                problems.append(f"{name}: expected a tensor with data, got {type(tensor).__name__}")
                continue
            dtype_name = str(dtype).removeprefix("torch.")
            if tuple(shape) != spec.shape:
                problems.append(f"{name}: shape {tuple(shape)} != expected {spec.shape}")
            if dtype_name != spec.dtype:
                problems.append(f"{name}: dtype {dtype_name} != expected {spec.dtype}")
        if require_complete:
            missing = [s.name for s in self.spec if s.name not in named_tensors]
            if missing:
                problems.append(f"{len(missing)} weight(s) missing, e.g. {missing[:3]}; a complete set is required")
        if problems:
            more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightMismatch("weights do not match the model: " + "; ".join(problems[:5]) + more)

    def record(self, named_tensors: Mapping[str, Any]) -> None:
        """Note that ``named_tensors`` are now served."""
        if self._keep_tensors:
            self._installed.update(named_tensors)
        elif named_tensors:
            self.exportable = False

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for every weight: installed ones, else the checkpoint's (cast to the served dtype)."""
        for spec in self.spec:
            tensor = self._installed.get(spec.name)
            if tensor is None:
                tensor = read_tensor(self._files[spec.name], spec.name, spec.dtype)
            yield spec.name, tensor
