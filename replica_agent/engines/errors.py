"""Exceptions raised by inference engines.

The engine library knows nothing about gRPC. Each exception derives from the
mesh's grpc-free error base (:mod:`mesh_runtime.failures`), naming the
canonical status code it stands for (``code``) and a contract ``reason``, so a
server answers with it as it is, without a translation table.
"""

from __future__ import annotations

from mesh_runtime.failures import RollmeshError
from mesh_runtime.reasons import Reason


class EngineError(RollmeshError):
    """Base class of every error an engine raises on purpose: ``INTERNAL`` unless a subclass says otherwise."""

    code = "INTERNAL"
    default_reason = Reason.ENGINE_ERROR


class InvalidRequest(EngineError):
    """The request is malformed (bad sampling parameters, empty prompt, a
    resume prefix that already reaches ``max_tokens``, token ids outside the
    vocabulary...). Retrying it unchanged cannot succeed. ``INVALID_ARGUMENT``.
    """

    code = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_REQUEST


class EngineUnavailable(EngineError):
    """The engine cannot serve right now but may later: it is starting,
    paused, asleep, or has no weights loaded. ``UNAVAILABLE`` (retry-able,
    typically on another replica).
    """

    code = "UNAVAILABLE"
    default_reason = Reason.ENGINE_UNAVAILABLE


class DuplicateRequest(EngineError):
    """A request with this id is already in flight on this engine.
    ``ALREADY_EXISTS``.
    """

    code = "ALREADY_EXISTS"
    default_reason = Reason.DUPLICATE_REQUEST


class CacheInUse(EngineError):
    """The cache cannot be flushed while requests hold blocks of it (SGLang's and vLLM's rule)."""

    code = "FAILED_PRECONDITION"
    default_reason = Reason.CACHE_IN_USE


class WeightMismatch(EngineError):
    """Offered weights do not match the model (unknown name, wrong shape or
    dtype, or an incomplete set where a complete one is required). Nothing was
    changed; the old weights still serve. ``FAILED_PRECONDITION``.
    """

    code = "FAILED_PRECONDITION"
    default_reason = Reason.WEIGHT_MISMATCH


class EngineDead(EngineError):
    """The engine's decode loop failed or the engine was closed; it will not
    recover and must be recreated. ``INTERNAL`` for the request at hand; the
    replica should be reported unhealthy.
    """

    code = "INTERNAL"
    default_reason = Reason.ENGINE_DEAD
