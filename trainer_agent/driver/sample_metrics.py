"""Per-step metrics of the samples a step trained on: staleness by weight version, and multi-turn counts.

Staleness of a sample is the trainer's weight version when it trains on the sample minus the **oldest**
weight version among the sample's generated tokens (a trajectory that spans weight syncs counts from its
first turn; tool and user tokens, version -1, do not count). The trainer trains on every sample as it is:
the GRPO loss weighs each token by the ratio of the current policy to the rollout logprob it was sampled
with (clipped), which is what corrects for tokens of older versions; staleness is bounded by
``staleness_threshold`` upstream (the rollouter's budget) and reported here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .queue import Sample


def oldest_version(sample: Sample) -> int | None:
    versions = [v for v, n in zip(sample.weight_versions, sample.segment_lengths) if v >= 0 and n > 0]
    return min(versions) if versions else None


def single_version(sample: Sample) -> int | None:
    """The one weight version all of ``sample``'s generated tokens were sampled under; None if several or none."""
    versions = {v for v, n in zip(sample.weight_versions, sample.segment_lengths) if v >= 0 and n > 0}
    return versions.pop() if len(versions) == 1 else None


def step_sample_metrics(samples: Sequence[Sample], trainer_version: int) -> dict[str, Any]:
    """``staleness/mean`` and ``/max``, ``multi_turn/*`` means when any sample has more than one turn, and
    ``tokens_by_weight_version`` (model tokens per version, for ``steps.jsonl``)."""
    out: dict[str, Any] = {}
    stale = [trainer_version - v for s in samples if (v := oldest_version(s)) is not None]
    if stale:
        out["staleness/mean"] = sum(stale) / len(stale)
        out["staleness/max"] = float(max(stale))
    spanning = sum(1 for s in samples if len({v for v in s.weight_versions if v >= 0}) > 1)
    out["staleness/samples_spanning_versions"] = float(spanning)
    if any(s.assistant_turns > 1 or s.user_turns or s.tool_calls for s in samples):
        count = len(samples)
        for key in ("assistant_turns", "user_turns", "tool_calls", "tool_errors", "tool_reward"):
            out[f"multi_turn/{key}/mean"] = sum(float(getattr(s, key)) for s in samples) / count
        out["multi_turn/tool_crashes"] = float(sum(1 for s in samples if s.finish_reason == "tool_error"))
        out["multi_turn/model_tokens/mean"] = sum(sum(s.loss_mask) if s.loss_mask else len(s.completion_ids)
                                                  for s in samples) / count
    by_version: Counter[int] = Counter()
    for s in samples:
        for version, length in zip(s.weight_versions, s.segment_lengths):
            if version >= 0:
                by_version[version] += length
    out["tokens_by_weight_version"] = {str(v): n for v, n in sorted(by_version.items())}
    return out
