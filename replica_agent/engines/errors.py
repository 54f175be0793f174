"""Exceptions raised by inference engines.

The engine library knows nothing about gRPC. Each exception carries a stable,
UPPER_SNAKE ``reason`` and documents the canonical status a server should map
it to; the replica agent's single error-mapping module does the translation.
"""

from __future__ import annotations
from mesh_runtime.reasons import Reason


class EngineError(Exception):
    """Base class of every error an engine raises on purpose.

    Maps to ``INTERNAL`` unless a subclass says otherwise.
    """

    reason = Reason.ENGINE_ERROR

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason


class InvalidRequest(EngineError):
    """The request is malformed (bad sampling parameters, empty prompt, a
    resume prefix that already reaches ``max_tokens``, token ids outside the
    vocabulary...). Retrying it unchanged cannot succeed. ``INVALID_ARGUMENT``.
    """

    reason = Reason.INVALID_REQUEST


class EngineUnavailable(EngineError):
    """The engine cannot serve right now but may later: it is starting,
    paused, asleep, or has no weights loaded. ``UNAVAILABLE`` (retry-able,
    typically on another replica).
    """

    reason = Reason.ENGINE_UNAVAILABLE


class DuplicateRequest(EngineError):
    """A request with this id is already in flight on this engine.
    ``ALREADY_EXISTS``.
    """

    reason = Reason.DUPLICATE_REQUEST


class WeightMismatch(EngineError):
    """Offered weights do not match the model (unknown name, wrong shape or
    dtype, or an incomplete set where a complete one is required). Nothing was
    changed; the old weights still serve. ``FAILED_PRECONDITION``.
    """

    reason = Reason.WEIGHT_MISMATCH


class EngineDead(EngineError):
    """The engine's decode loop failed or the engine was closed; it will not
    recover and must be recreated. ``INTERNAL`` for the request at hand; the
    replica should be reported unhealthy.
    """

    reason = Reason.ENGINE_DEAD
