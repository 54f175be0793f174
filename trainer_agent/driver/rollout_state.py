"""The rollouter's groups in flight and their form in a checkpoint: every admitted group not yet queued, with
the samples of it that already completed (in-flight requests are saved as not yet generated)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trainer_agent.driver.queue import Sample
from trainer_agent.driver.rollout_types import Prompt

STATE_VERSION = 1
"""The version of the rollouter's ``state_dict``; a snapshot of another one is refused."""


@dataclass
class Group:
    """One prompt's ``n`` samples on their way: the ones done and the indices in flight."""

    group_id: str
    prompt: Prompt
    done: dict[int, Sample] = field(default_factory=dict)
    in_flight: set[int] = field(default_factory=set)


def encode_pending(groups: Iterable[Group]) -> list[dict[str, Any]]:
    """The groups as the checkpoint holds them (JSON-friendly)."""
    return [{"group_id": g.group_id, "prompt_id": g.prompt.prompt_id, "prompt_ids": list(g.prompt.token_ids),
             "done": [g.done[i].to_dict() for i in sorted(g.done)]} for g in groups]


def decode_pending(entries: Iterable[dict[str, Any]]) -> list[Group]:
    """The groups a checkpoint holds, none of them in flight."""
    groups = []
    for entry in entries:
        group = Group(group_id=str(entry["group_id"]),
                      prompt=Prompt(str(entry["prompt_id"]), [int(t) for t in entry["prompt_ids"]]))
        for d in entry["done"]:
            sample = Sample.from_dict(d)
            group.done[sample.index] = sample
        groups.append(group)
    return groups
