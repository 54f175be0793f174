"""Weight bookkeeping for the torch engine: spec, checks, swap, offload.

Parameters are addressed by their Hugging Face names. Tied parameters (e.g.
``lm_head.weight`` sharing ``model.embed_tokens.weight``) appear once in the
spec under their first name; the alias is accepted on load and updates the
shared tensor.

Sleeping replaces every module parameter with a storage-less ``meta``
parameter, so the model itself no longer references any weight memory.
Level 1 keeps the old tensors in a host-side dict (a copy to CPU on an
accelerator; on CPU the very same tensors are moved there, since host and
device memory coincide). Level 2 keeps nothing, so the storage is returned
to the allocator as soon as the last reference goes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .errors import WeightMismatch
from .types import WeightSpec


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class ModelWeights:
    """Names, slots and (off)loading of one model's parameters."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._slots: dict[str, list[tuple[nn.Module, str]]] = {}
        self._canonical: dict[str, str] = {}
        by_identity: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            module_path, _, attr = name.rpartition(".")
            module = model.get_submodule(module_path) if module_path else model
            canonical = by_identity.setdefault(id(param), name)
            self._canonical[name] = canonical
            self._slots.setdefault(canonical, []).append((module, attr))
        self.spec = [
            WeightSpec(name, dtype_name(p.dtype), tuple(p.shape)) for name, p in self._params()
        ]
        self._spec_by_name = {s.name: s for s in self.spec}
        self.host_copy: dict[str, torch.Tensor] | None = None

    def _params(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, slots in self._slots.items():
            module, attr = slots[0]
            yield name, getattr(module, attr)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._params():
            yield name, param.detach()

    def resident_bytes(self) -> int:
        """Bytes of parameter storage the model currently references."""
        return sum(p.untyped_storage().nbytes() for _, p in self._params() if not p.is_meta)

    def _install(self, name: str, tensor: torch.Tensor) -> None:
        param = nn.Parameter(tensor, requires_grad=False)
        for module, attr in self._slots[name]:
            setattr(module, attr, param)

    # ------------------------------------------------------------------ checks
    def check(self, named_tensors: Mapping[str, Any], require_complete: bool) -> None:
        """Raise WeightMismatch unless every tensor fits its parameter."""
        problems: list[str] = []
        covered: set[str] = set()
        for name, tensor in named_tensors.items():
            canonical = self._canonical.get(name)
            if canonical is None:
                problems.append(f"unknown weight {name!r}")
                continue
            spec = self._spec_by_name[canonical]
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                problems.append(f"{name}: expected a tensor with data, got {type(tensor).__name__}")
                continue
            if tuple(tensor.shape) != spec.shape:
                problems.append(f"{name}: shape {tuple(tensor.shape)} != expected {spec.shape}")
            if dtype_name(tensor.dtype) != spec.dtype:
                problems.append(f"{name}: dtype {dtype_name(tensor.dtype)} != expected {spec.dtype}")
            covered.add(canonical)
        if require_complete:
            missing = [s.name for s in self.spec if s.name not in covered]
            if missing:
                problems.append(f"{len(missing)} weight(s) missing, e.g. {missing[:3]}; a complete set is required")
        if problems:
            more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
            raise WeightMismatch("weights do not match the model: " + "; ".join(problems[:5]) + more)

    def swap(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked tensors into the resident parameters."""
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                module, attr = self._slots[self._canonical[name]][0]
                getattr(module, attr).copy_(tensor)

    # ------------------------------------------------------------ sleep/wake
    def release(self, level: int, resident: bool) -> int:
        """Drop resident weights (keeping a host copy at level 1); at level 2
        also drop an existing host copy. Returns the bytes freed."""
        freed = 0
        if resident:
            keep: dict[str, torch.Tensor] = {}
            for name, param in list(self._params()):
                freed += param.untyped_storage().nbytes()
                if level == 1:
                    keep[name] = _to_host(param.detach())
                self._install(name, torch.empty(param.shape, dtype=param.dtype, device="meta"))
            self.host_copy = keep if level == 1 else None
        elif level == 2 and self.host_copy is not None:
            freed += sum(t.untyped_storage().nbytes() for t in self.host_copy.values())
            self.host_copy = None
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def restore(self) -> bool:
        """Bring weights back: from the host copy (True) or uninitialised (False)."""
        host, self.host_copy = self.host_copy, None
        for spec in self.spec:
            if host is not None:
                tensor = host.pop(spec.name).to(self.device)
            else:
                tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=self.device)
            self._install(spec.name, tensor)
        return host is not None


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return t.to("cpu", copy=True)
