"""Publishing a trainer's weights for the trainer agent's ``DirectoryWeightSource`` (docs/custom-trainers.md).

Here, not in the agent, so that a trainer in an environment of its own (verl's, through the ``rollmesh_verl``
plugin) publishes with torch alone, without the agent's dependencies.

A version is a safetensors file (any safetensors reader opens it), written and read here without the copies a
general reader and writer make: :func:`publish` writes each tensor's bytes straight from its memory, and
:func:`read_published` maps the file and returns tensors over the mapping (copy-on-write), so a version costs
one copy on the trainer's side (into the file, in ``/dev/shm`` a memory copy) and none on the agent's until it
packs the broadcast, as many as when the agent holds the model itself.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_HEADER_LIMIT = 100 << 20   # a header larger than this is not a weights file's


def _dtypes() -> dict[Any, str]:
    import torch

    table = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    for name, code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
        if hasattr(torch, name):
            table[getattr(torch, name)] = code
    return table


def publish(directory: str | Path, tensors: Mapping[str, Any], weight_version: int) -> Path:
    """Write ``tensors`` (name -> torch tensor) as version ``weight_version``: ``DIRECTORY/<version>.safetensors``,
    written under a temporary name in the same directory and renamed, so a half-written file is never read."""
    import torch

    codes = _dtypes()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{int(weight_version)}.safetensors"
    partial = directory / f".{int(weight_version)}.safetensors.partial"
    flat: list[tuple[str, torch.Tensor]] = []
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "weight_version": str(int(weight_version))}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in codes:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": codes[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        flat.append((name, tensor))
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)   # the data starts 8-byte aligned, as safetensors writes it
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for _, tensor in flat:
            if tensor.numel():
                out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    partial.rename(final)
    return final


def read_published(path: str | Path) -> dict[str, Any]:
    """The tensors of a safetensors file, over a copy-on-write mapping of it (no copy is made until one is
    written to; the mapping outlives the file's deletion). Raises ``ValueError`` for a file that is not one."""
    import torch

    codes = {code: dtype for dtype, code in _dtypes().items()}
    with open(path, "rb") as source:
        head = source.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(source.read(length))
        except ValueError as err:
            raise ValueError(f"{path}: not a safetensors file (header: {err})") from None
        size = source.seek(0, 2)
        mapped = mmap.mmap(source.fileno(), 0, access=mmap.ACCESS_COPY)   # at least the 8 bytes read
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = codes.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name}: dtype {entry['dtype']!r} is not one torch reads here")
        if not 0 <= begin <= end <= size - start:
            raise ValueError(f"{path}: {name}: data_offsets {entry['data_offsets']} outside the file")
        shape = entry["shape"]
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def published_versions(directory: str | Path) -> list[int]:
    """The versions published in ``directory`` (``<version>.safetensors``), oldest first."""
    return sorted(int(p.stem) for p in Path(directory).glob("*.safetensors") if p.stem.isdigit())


def prune(directory: str | Path, below: int) -> list[int]:
    """Delete the versions older than ``below`` from ``directory`` (once the trainer agent holds ``below``, it
    never reads them again: a version a trainer publishes per step would otherwise fill the disk, /dev/shm
    first); the versions deleted."""
    gone = [version for version in published_versions(directory) if version < below]
    for version in gone:
        (Path(directory) / f"{version}.safetensors").unlink(missing_ok=True)
    return gone
