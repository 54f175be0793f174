"""Weight names, dtypes and shapes of a local Hugging Face safetensors checkpoint.

Backends that do not hold their weights in this process (vLLM keeps them in
worker processes, fused and possibly sharded) still need the Hugging Face
view of the model: the names, dtypes and shapes a trainer sends. The
safetensors format starts every file with a little-endian 64-bit length and
a JSON header describing each tensor, so that view can be read without
loading any tensor data and without torch.

Only :func:`read_tensor` touches tensor data; it imports torch and the
``safetensors`` package when it is called.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mesh_runtime.reasons import Reason
from .errors import EngineError
from .types import WeightSpec

INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})

# Non-parameter tensors some older checkpoints carry; model loaders skip them,
# so a trainer never sends them and they must not be required.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(EngineError):
    """The model directory holds no readable safetensors checkpoint."""

    default_reason = Reason.CHECKPOINT_UNREADABLE


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: those named by the index file
    when there is one (other ``*.safetensors`` files may be unrelated copies),
    otherwise every ``*.safetensors`` file, sorted."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc}") from exc
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root} holds no *.safetensors files; the checkpoint must be in safetensors format")
    return files


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (``__metadata__`` removed)."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path} is too short to be a safetensors file")
            (length,) = struct.unpack("<Q", raw_len)
            if length > _MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header of {length} bytes is implausibly large")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path}: malformed safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header


def checkpoint_spec(
    model_dir: str | Path, serving_dtype: str | None = None
) -> tuple[list[WeightSpec], dict[str, Path]]:
    """Spec of every parameter tensor in the checkpoint, sorted by name, and
    the file that holds each one.

    ``serving_dtype`` replaces the dtype of floating-point tensors: an engine
    that casts the checkpoint on load serves (and accepts) that dtype.
    """
    specs: dict[str, WeightSpec] = {}
    where: dict[str, Path] = {}
    for path in checkpoint_files(model_dir):
        for name, entry in read_header(path).items():
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            try:
                dtype = _DTYPE_NAMES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{path}: unreadable entry for {name!r}: {entry!r}") from exc
            if serving_dtype is not None and dtype in FLOAT_DTYPES:
                dtype = serving_dtype
            specs[name] = WeightSpec(name, dtype, shape)
            where[name] = path
    return [specs[n] for n in sorted(specs)], where


def read_tensor(path: Path, name: str, dtype: str | None = None) -> Any:
    """Load one tensor from ``path`` (as a CPU torch tensor, cast to ``dtype``)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        tensor = f.get_tensor(name)
    if dtype is not None and str(tensor.dtype).removeprefix("torch.") != dtype:
        tensor = tensor.to(getattr(torch, dtype))
    return tensor
