"""The mesh's one error base, free of gRPC: what every layer raises on purpose.

:class:`RollmeshError` and its subclasses, one per canonical status code, name that code (``code``, a
``grpc.StatusCode`` member name), a contract reason and structured metadata. The controller core
(:mod:`controller.core.errors`) and the inference engines (:mod:`replica_agent.engines.errors`) subclass
them, so their errors need no translation: a server turns any of them into its status in one place
(:func:`mesh_runtime.errors.abort_mapped`). This module imports no gRPC, so packages that must not (the
controller core, the engine library) can raise mesh errors.
"""

from __future__ import annotations

from collections.abc import Mapping

from .reasons import Reason


class ConfigError(ValueError):
    """A configuration value is missing, unknown, mistyped or inconsistent (raised at start-up, before any
    server runs; :mod:`mesh_runtime.config` hands it on)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"config key '{key}': {why}" if key else why)
        self.key = key
        self.why = why


NON_RETRYABLE = "non_retryable"
"""The ``ErrorInfo`` metadata key of an error its caller must not retry (:attr:`RollmeshError.non_retryable`)."""


class RollmeshError(Exception):
    """Base of every error rollmesh raises on purpose: servers, the controller core and the engines.

    ``reason`` is one of the contract's :class:`~mesh_runtime.reasons.Reason` values
    (``ValueError`` for any other string); ``metadata`` carries structured context
    (for example the id of a conflicting operation).
    """

    code = "INTERNAL"
    """The name of the canonical status code it stands for (``grpc.StatusCode`` member names)."""
    default_reason = Reason.INTERNAL

    def __init__(self, message: str, *, reason: str | None = None,
                 metadata: Mapping[str, object] | None = None, retry_delay_s: float | None = None,
                 non_retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.reason = Reason(reason or self.default_reason)
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_delay_s = retry_delay_s
        """When set, the status also carries a ``google.rpc.RetryInfo``: retry after this long."""
        if non_retryable:
            self.metadata[NON_RETRYABLE] = "true"

    @property
    def non_retryable(self) -> bool:
        """The server already retried this (and spent its budget): the caller must not retry it again. Carried
        as ``non_retryable: true`` in the ``ErrorInfo`` metadata, so it crosses every hop."""
        return self.metadata.get(NON_RETRYABLE) == "true"


class InvalidArgument(RollmeshError):
    """The request itself is malformed; retrying it unchanged cannot succeed."""

    code = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_ARGUMENT


class NotFound(RollmeshError):
    """A named resource (replica, node, operation, request) does not exist."""

    code = "NOT_FOUND"
    default_reason = Reason.NOT_FOUND


class AlreadyExists(RollmeshError):
    """A resource with this id already exists or is in flight."""

    code = "ALREADY_EXISTS"
    default_reason = Reason.ALREADY_EXISTS


class FailedPrecondition(RollmeshError):
    """The system is not in a state that allows the call."""

    code = "FAILED_PRECONDITION"
    default_reason = Reason.FAILED_PRECONDITION


class Aborted(RollmeshError):
    """A conflicting concurrent operation prevents this one."""

    code = "ABORTED"
    default_reason = Reason.ABORTED


class Cancelled(RollmeshError):
    """The work was cancelled (a cancelled long-running operation's error)."""

    code = "CANCELLED"
    default_reason = Reason.CANCELLED


class OutOfRange(RollmeshError):
    """A position (sequence number, cycle index) is outside the valid range."""

    code = "OUT_OF_RANGE"
    default_reason = Reason.OUT_OF_RANGE


class ResourceExhausted(RollmeshError):
    """A quota or capacity (slots, retry budget, buffer) is used up."""

    code = "RESOURCE_EXHAUSTED"
    default_reason = Reason.RESOURCE_EXHAUSTED


class Unavailable(RollmeshError):
    """Transiently unable to serve; the caller may retry (possibly elsewhere)."""

    code = "UNAVAILABLE"
    default_reason = Reason.UNAVAILABLE


class DeadlineExceeded(RollmeshError):
    """The work did not finish within its deadline or timeout."""

    code = "DEADLINE_EXCEEDED"
    default_reason = Reason.DEADLINE_EXCEEDED


class Unauthenticated(RollmeshError):
    """The call carries no valid credential."""

    code = "UNAUTHENTICATED"
    default_reason = Reason.UNAUTHENTICATED


class PermissionDenied(RollmeshError):
    """The credential is valid but does not allow this call."""

    code = "PERMISSION_DENIED"
    default_reason = Reason.PERMISSION_DENIED


class Unimplemented(RollmeshError):
    """The RPC belongs to a capability this server does not offer (yet)."""

    code = "UNIMPLEMENTED"
    default_reason = Reason.CAPABILITY_NOT_IMPLEMENTED


class Internal(RollmeshError):
    """An invariant broke inside the server."""

    code = "INTERNAL"
    default_reason = Reason.INTERNAL
