"""The one rule set of a generation request, for both sides that hold one.

On the wire (:func:`check_generation`: the balancer and the agents, on a decoded message) and in an engine
called in-process (:func:`replica_agent.engines.types.validate_request`, on the engine's dataclasses), the
same rules (:func:`check_request_head`, :func:`check_sampling_values`, :func:`check_resumed`) reject the same bad input with the
same message and reason; only the error class differs (``InvalidArgument`` here, the engines'
``InvalidRequest``, both ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollmesh.common.v1 import generation_pb2

from .durations import to_seconds
from .failures import InvalidArgument, RollmeshError
from .reasons import Reason

if TYPE_CHECKING:
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2
    from rollmesh.replica.v1 import replica_agent_pb2

    AnyGenerateRequest = loadbalancer_pb2.GenerateRequest | replica_agent_pb2.GenerateRequest


def temperature_of(sp: generation_pb2.SamplingParams) -> float:
    return sp.temperature if sp.HasField("temperature") else 1.0


def top_p_of(sp: generation_pb2.SamplingParams) -> float:
    return sp.top_p if sp.HasField("top_p") else 1.0


MAX_SEED = 2**64 - 1
"""The largest sampling seed (the contract's ``uint64``)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_token_ids(ids: Sequence[int], what: str, *, error: type[RollmeshError] = InvalidArgument,
                    typed: bool = True, vocab_size: int | None = None) -> None:
    """Raise ``error`` unless ``ids`` are token ids (non-negative integers, below ``vocab_size`` when given);
    ``typed``: the values come from a decoded message, so they are integers already."""
    if not typed and not isinstance(ids, (list, tuple)):
        raise error(f"{what} must be a list of token ids", reason=Reason.INVALID_TOKEN_ID)
    if not ids or ((typed or set(map(type, ids)) == {int}) and min(ids) >= 0
                   and (vocab_size is None or max(ids) < vocab_size)):
        return   # the usual case, checked at C speed; otherwise find the first bad one below
    for t in ids:
        if not _is_int(t) or t < 0:
            raise error(f"{what} holds {str(t)[:32]}; token ids are non-negative integers",
                        reason=Reason.INVALID_TOKEN_ID)
        if vocab_size is not None and t >= vocab_size:
            raise error(f"{what} holds token id {t}, outside the vocabulary of {vocab_size}",
                        reason=Reason.INVALID_TOKEN_ID)


def check_sampling_values(*, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
                          stop_token_ids: Sequence[int], error: type[RollmeshError] = InvalidArgument,
                          prefix: str = "sampling_params.", typed: bool = True) -> None:
    """The sampling parameters' rules, whichever side holds them; raise ``error`` naming the first bad one
    (``prefix``: how the caller's request names its sampling parameters)."""
    def bad(message: str) -> RollmeshError:
        return error(f"{prefix}{message}", reason=Reason.INVALID_SAMPLING_PARAMS)

    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad(f"max_tokens must be an integer > 0, got {str(max_tokens)[:32]}")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be a finite number >= 0 (0 = greedy), got {str(temperature)[:32]}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {str(top_p)[:32]}")
    if not _is_int(top_k) or top_k < -1:
        raise bad(f"top_k must be an integer >= -1 (0 or -1 disable it), got {str(top_k)[:32]}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise bad(f"seed must be an integer in [0, 2**64), got {str(seed)[:32]}")
    try:
        check_token_ids(stop_token_ids, "stop_token_ids", error=error, typed=typed)
    except RollmeshError as err:
        raise bad(err.message) from None


def check_request_head(request_id: str, prompt_token_ids: Sequence[int], *,
                       error: type[RollmeshError] = InvalidArgument, typed: bool = True) -> None:
    """A generation request's id and prompt, whichever side holds it."""
    if not isinstance(request_id, str) or not request_id:
        raise error("request_id must be a non-empty string", reason=Reason.EMPTY_REQUEST_ID)
    if not prompt_token_ids:
        raise error(f"request {request_id[:64]}: prompt_token_ids must not be empty", reason=Reason.EMPTY_PROMPT)
    check_token_ids(prompt_token_ids, "prompt_token_ids", error=error, typed=typed)


def check_resumed(request_id: str, segments: Sequence[tuple[Sequence[int], Sequence[float]]], max_tokens: int, *,
                  error: type[RollmeshError] = InvalidArgument, typed: bool = True) -> None:
    """A generation request's resumed completion (``segments``: its ``(token_ids, logprobs)`` runs), which must
    leave something of ``max_tokens`` to generate, whichever side holds it."""
    resumed = 0
    for index, (token_ids, logprobs) in enumerate(segments):
        check_token_ids(token_ids, f"resume_segments[{index}].token_ids", error=error, typed=typed)
        if logprobs and len(logprobs) != len(token_ids):
            raise error(f"resume_segments[{index}] has {len(logprobs)} logprobs for {len(token_ids)} tokens: "
                        "logprobs must be empty or as long as token_ids", reason=Reason.INVALID_RESUME_SEGMENT)
        resumed += len(token_ids)
    if resumed >= max_tokens:
        raise error(f"request {request_id[:64]}: resume_segments already hold {resumed} tokens, which meets "
                    f"max_tokens={max_tokens}: nothing is left to generate", reason=Reason.BUDGET_SPENT)


def check_sampling(sp: generation_pb2.SamplingParams) -> None:
    """Raise ``InvalidArgument`` naming the first bad sampling parameter of a decoded message."""
    check_sampling_values(max_tokens=sp.max_tokens, temperature=temperature_of(sp), top_p=top_p_of(sp),
                          top_k=sp.top_k, seed=sp.seed if sp.HasField("seed") else None,
                          stop_token_ids=sp.stop_token_ids)


def check_generation(request_id: str, prompt_token_ids: Sequence[int], sampling: generation_pb2.SamplingParams,
                     resume_segments: Sequence[generation_pb2.TokenSegment]) -> None:
    """Raise ``InvalidArgument`` for a decoded request no replica could serve (the balancer's and the agents'
    check, before any routing or engine work)."""
    check_request_head(request_id, prompt_token_ids)
    check_sampling(sampling)
    if resume_segments:
        check_resumed(request_id, [(s.token_ids, s.logprobs) for s in resume_segments], sampling.max_tokens)


def flush_interval_of(msg: AnyGenerateRequest) -> float | None:
    """A Generate request's ``flush_interval`` in seconds; None when unset."""
    return to_seconds(msg.flush_interval) if msg.HasField("flush_interval") else None


def check_duration(msg: Any, field: str, reason: str) -> float | None:
    """A message's optional Duration ``field`` in seconds (None when unset); ``InvalidArgument`` with
    ``reason`` when it is negative."""
    if not msg.HasField(field):
        return None
    value = getattr(msg, field)
    if value.seconds < 0 or value.nanos < 0:
        raise InvalidArgument(f"{field} must not be negative, got {value.seconds}s {value.nanos}ns", reason=reason)
    return to_seconds(value)


def check_streaming(msg: AnyGenerateRequest) -> None:
    """Raise ``InvalidArgument`` for a Generate request's bad ``stream_interval`` or ``flush_interval``."""
    if msg.HasField("stream_interval") and msg.stream_interval == 0:
        raise InvalidArgument("stream_interval must be > 0 when set", reason=Reason.INVALID_STREAM_INTERVAL)
    check_duration(msg, "flush_interval", Reason.INVALID_STREAM_INTERVAL)
