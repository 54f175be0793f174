"""Publishing a trainer's weights for the trainer agent's ``DirectoryWeightSource`` (docs/custom-trainers.md).

Here, not in the agent, so that a trainer in an environment of its own (verl's, through the ``rollmesh_verl``
plugin) publishes with torch and safetensors alone, without the agent's dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def publish(directory: str | Path, tensors: Mapping[str, Any], weight_version: int) -> Path:
    """Write ``tensors`` (name -> torch tensor) as version ``weight_version``: ``DIRECTORY/<version>.safetensors``,
    written under a temporary name in the same directory and renamed, so a half-written file is never read."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{int(weight_version)}.safetensors"
    partial = directory / f".{int(weight_version)}.safetensors.partial"
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(partial))
    partial.rename(final)
    return final
