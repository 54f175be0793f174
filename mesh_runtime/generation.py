"""Checks of generation requests on the wire, shared by the balancer and the agents.

Both servers reject the same bad input with the same ``INVALID_ARGUMENT``
message before any routing or engine work happens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollmesh.common.v1 import generation_pb2

from .durations import to_seconds
from .errors import InvalidArgument
from .reasons import Reason

if TYPE_CHECKING:
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2
    from rollmesh.replica.v1 import replica_agent_pb2

    AnyGenerateRequest = loadbalancer_pb2.GenerateRequest | replica_agent_pb2.GenerateRequest


def temperature_of(sp: generation_pb2.SamplingParams) -> float:
    return sp.temperature if sp.HasField("temperature") else 1.0


def top_p_of(sp: generation_pb2.SamplingParams) -> float:
    return sp.top_p if sp.HasField("top_p") else 1.0


def check_sampling(sp: generation_pb2.SamplingParams) -> None:
    """Raise ``InvalidArgument`` naming the first bad sampling parameter."""
    def bad(message: str) -> InvalidArgument:
        return InvalidArgument(f"sampling_params.{message}", reason=Reason.INVALID_SAMPLING_PARAMS)

    if sp.max_tokens == 0:
        raise bad("max_tokens must be > 0")
    temperature, top_p = temperature_of(sp), top_p_of(sp)
    if not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p}")
    if sp.top_k < -1:
        raise bad(f"top_k must be >= -1 (0 or -1 disable it), got {sp.top_k}")
    if any(t < 0 for t in sp.stop_token_ids):
        raise bad("stop_token_ids must not be negative")


def check_generation(request_id: str, prompt_token_ids: Sequence[int], sampling: generation_pb2.SamplingParams,
                     resume_segments: Sequence[generation_pb2.TokenSegment]) -> None:
    """Raise ``InvalidArgument`` for a request no replica could serve."""
    if not request_id:
        raise InvalidArgument("request_id must not be empty", reason=Reason.EMPTY_REQUEST_ID)
    if not prompt_token_ids:
        raise InvalidArgument("prompt_token_ids must not be empty", reason=Reason.EMPTY_PROMPT)
    if min(prompt_token_ids) < 0:
        raise InvalidArgument("prompt_token_ids must not be negative", reason=Reason.INVALID_TOKEN_ID)
    check_sampling(sampling)
    for index, seg in enumerate(resume_segments):
        if seg.logprobs and len(seg.logprobs) != len(seg.token_ids):
            raise InvalidArgument(f"resume_segments[{index}]: logprobs must be empty or as long as token_ids",
                                  reason=Reason.INVALID_RESUME_SEGMENT)
    resumed = sum(len(s.token_ids) for s in resume_segments)
    if resumed >= sampling.max_tokens:
        raise InvalidArgument(f"resume_segments already hold {resumed} tokens, which spends the max_tokens "
                              f"budget of {sampling.max_tokens}", reason=Reason.BUDGET_SPENT)


def flush_interval_of(msg: AnyGenerateRequest) -> float | None:
    """A Generate request's ``flush_interval`` in seconds; None when unset."""
    return to_seconds(msg.flush_interval) if msg.HasField("flush_interval") else None


def check_streaming(msg: AnyGenerateRequest) -> None:
    """Raise ``InvalidArgument`` for a Generate request's bad ``stream_interval`` or ``flush_interval``."""
    if msg.HasField("stream_interval") and msg.stream_interval == 0:
        raise InvalidArgument("stream_interval must be > 0 when set", reason=Reason.INVALID_STREAM_INTERVAL)
    if msg.HasField("flush_interval") and (msg.flush_interval.seconds < 0 or msg.flush_interval.nanos < 0):
        raise InvalidArgument(f"flush_interval must not be negative, got {msg.flush_interval.seconds}s "
                              f"{msg.flush_interval.nanos}ns", reason=Reason.INVALID_STREAM_INTERVAL)
