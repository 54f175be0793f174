"""Job configs for the ``rollmesh train`` end-to-end tests: an example with some keys changed."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.job_config import JobConfig
from mesh_runtime.config import resolve_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def job_config(tmp: Path, example: str, name: str | None = None, **changes) -> Path:
    """Write ``examples/<example>`` with dotted-key ``changes`` applied to ``tmp/<name or example>``."""
    # the example's paths are relative to the example: the copy elsewhere keeps them pointing there
    data = resolve_paths(JobConfig, yaml.safe_load((EXAMPLES / example).read_text()), EXAMPLES)
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp / (name or example)
    path.write_text(yaml.safe_dump(data))
    return path
