"""Driver checkpoints: the model and optimizer together with the driver's samples and counters.

One file, ``driver.pt`` in the checkpoint directory, written atomically
(temporary file + rename) so a crash mid-write leaves the previous checkpoint
intact. It holds:

- ``trainer``: :meth:`GrpoTrainer.state_dict` (parameters, AdamW state, weight version);
- ``driver``: :meth:`FullyAsyncLoop.state_dict` (queued samples, admitted groups
  with their finished samples, counters, the next global step);
- ``records``: the steps done so far, as dicts;
- ``job``: what the checkpoint was trained on (model preset, task, group size),
  so ``rollmesh train --resume`` can refuse a config that cannot continue it
  before anything starts (:func:`checkpoint_info` reads it back).

Restoring all three together is what keeps a restart from silently losing
the samples in flight (known weakness 17): queued samples are trained on,
finished samples of unfinished groups are kept, and the requests that were
in flight are generated again.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

FILE_NAME = "driver.pt"
FORMAT_VERSION = 1


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / FILE_NAME


def save_checkpoint(directory: str | Path, *, trainer_state: dict, driver_state: dict,
                    records: list[Any], job: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint atomically; returns its path."""
    path = checkpoint_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT_VERSION, "trainer": trainer_state, "driver": driver_state,
               "records": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) and not isinstance(r, type) else dict(r)
                           for r in records],
               "job": dict(job or {})}
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | Path) -> dict | None:
    """The saved payload, or None when the directory holds no checkpoint."""
    path = checkpoint_path(directory)
    if not path.is_file():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if int(payload.get("format", 0)) != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint format {payload.get('format')!r}")
    return payload


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about the run it belongs to (without the tensors' meaning)."""

    global_step: int
    """The last global step the checkpoint holds (the resumed run starts at the next one)."""
    weight_version: int
    queue_size: int
    pending_groups: int
    generated: int
    consumed: int
    dropped: int
    job: dict[str, Any]
    """``model``, ``task`` and ``rollout_n`` of the run that wrote it; empty for older checkpoints."""


def checkpoint_info(directory: str | Path) -> CheckpointInfo | None:
    """Summary of the checkpoint in ``directory``; None when there is none. Raises ValueError when unreadable."""
    try:
        payload = load_checkpoint(directory)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a torn or foreign file: say so, with the cause
        raise ValueError(f"{checkpoint_path(directory)}: not a readable checkpoint ({type(err).__name__}: {err})") \
            from err
    if payload is None:
        return None
    driver, queue = payload["driver"], payload["driver"]["queue"]
    return CheckpointInfo(
        global_step=int(driver["next_step"]) - 1, weight_version=int(payload["trainer"]["weight_version"]),
        queue_size=len(queue["samples"]), pending_groups=len(driver["rollouter"]["pending"]),
        generated=int(queue["generated"]), consumed=int(queue["consumed"]), dropped=int(queue["dropped"]),
        job=dict(payload.get("job") or {}))
