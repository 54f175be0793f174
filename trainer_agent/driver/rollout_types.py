"""The rollouter's vocabulary: the generation request and result, the rollout config and its history points.

``RolloutConfig`` holds the verl keys the rollouter uses and derives the
sample arithmetic (:mod:`mesh_runtime.samples`) in samples (prompts) and in
completions (x ``n``); ``HistoryPoint`` is one point of the section-4.2
concurrency history. The rollouter (:mod:`.rollouter`) re-exports all of it.

Units: a *sample* is one prompt with its ``n`` responses, as in verl
(:mod:`mesh_runtime.samples`), and ``ppo_mini_batch_size`` is in prompts::

    required_samples      = ppo_mini_batch_size * require_batches
    step_required_samples = required_samples * trigger_parameter_sync_step
    buffer_samples        = step_required_samples * staleness_threshold
    max_required_samples  = int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step)

Inside the rollouter and the queue the bookkeeping is per *completion* (one
load-balancer request, one response): ``required_completions`` and
``max_required_completions`` are the sample counts times ``n``, and since
groups enter and leave the queue whole, every completion count is exactly
``n`` times a sample count. ``step_generated_samples`` counts samples
(finished groups), as verl's rollouter does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh_runtime import samples
from mesh_runtime.rollout_metrics import ConcurrencyPoint
from mesh_runtime.rollout_metrics import rollout_resource_utilization as core_rollout_utilization


class GenerationError(RuntimeError):
    """A generation result that cannot be used (e.g. aborted); retryable."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    token_ids: list[int]


@dataclass
class Segment:
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    weight_version: int = 0
    replica_id: str = ""


@dataclass
class RolloutRequest:
    """What the rollouter asks the load balancer for (one completion)."""

    request_id: str
    prompt_token_ids: list[int]
    session_id: str
    partial_rollout: bool
    param_version: int
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = True
    retry_budget: int | None = None
    min_weight_version: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class GenerationResult:
    segments: list[Segment]
    finish_reason: str = "stop"  # "stop" | "length" | "aborted"


GenerateFn = Callable[[RolloutRequest], Awaitable[GenerationResult]]


@dataclass
class RolloutConfig(samples.SampleArithmetic):
    n: int
    ppo_mini_batch_size: int
    require_batches: int = 1
    trigger_parameter_sync_step: int = 4
    staleness_threshold: float = 0.1
    concurrent_samples_per_replica: int = 16
    partial_rollout: bool = True
    max_retries: int = 2
    retry_backoff_s: float = 0.0
    max_tokens: int = 1024
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = True
    lb_retry_budget: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (the tokenizer's EOS for a dataset; none for the copy task, whose answers
    fit max_tokens)."""

    def __post_init__(self) -> None:
        for name in ("n", "ppo_mini_batch_size", "require_batches", "trigger_parameter_sync_step",
                     "concurrent_samples_per_replica", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.staleness_threshold < 0:
            raise ValueError(f"staleness_threshold must be >= 0, got {self.staleness_threshold}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")



@dataclass(frozen=True)
class HistoryPoint:
    t: float
    active_tasks: int
    capacity: int
    kind: str


def rollout_resource_utilization(points: Sequence[HistoryPoint]) -> float:
    """Section 4.2 over the window's points: the shared formula (capacities are already clamped)."""
    history = [ConcurrencyPoint(t=p.t, active_tasks=p.active_tasks, capacity=p.capacity) for p in points]
    max_capacity = max((p.capacity for p in points), default=0)
    return core_rollout_utilization(history, concurrent_samples_per_replica=1, max_required_samples=max_capacity)


@dataclass
class RolloutTotals:
    """The rollouter's running totals since the run began (checkpointed, and in its ``stats()``)."""

    submitted_samples: int = 0
    completed_samples: int = 0
    groups_enqueued: int = 0
    dropped_by_queue: int = 0
    retries: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutTotals:
        return cls(**{f.name: int(data[f.name]) for f in dataclasses.fields(cls)})
