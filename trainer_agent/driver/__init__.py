"""Fully-async driver pieces: the bounded sample queue and the rollouter."""

from trainer_agent.driver.queue import (
    BatchResult,
    MessageQueue,
    QueueClosed,
    RolloutFailed,
    Sample,
)
from trainer_agent.driver.rollouter import (
    RolloutRequest,
    GenerationResult,
    HistoryPoint,
    Prompt,
    RolloutConfig,
    Rollouter,
    Segment,
    rollout_resource_utilization,
)

__all__ = [
    "BatchResult",
    "RolloutRequest",
    "GenerationResult",
    "HistoryPoint",
    "MessageQueue",
    "Prompt",
    "QueueClosed",
    "RolloutConfig",
    "RolloutFailed",
    "Rollouter",
    "Sample",
    "Segment",
    "rollout_resource_utilization",
]
