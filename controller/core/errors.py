"""Domain errors of the controller core.

The core never imports grpc: these exceptions derive from the mesh's grpc-free
error base (:mod:`mesh_runtime.failures`) and name the canonical status code
they stand for (``code``) and a contract ``reason``; a server maps them like
any mesh error. Messages say what was wrong and, where it helps, how to fix it.
"""

from __future__ import annotations

from mesh_runtime.failures import RollmeshError
from mesh_runtime.reasons import Reason


class CoreError(RollmeshError):
    """Base of every error the controller core raises on purpose."""

    code = "INTERNAL"
    default_reason = Reason.INTERNAL


class InvalidArgumentError(CoreError):
    """The input itself is malformed; repeating it unchanged cannot succeed."""

    code = "INVALID_ARGUMENT"
    default_reason = Reason.INVALID_ARGUMENT


class NotFoundError(CoreError):
    """A named node or replica is not in the registry."""

    code = "NOT_FOUND"
    default_reason = Reason.NOT_FOUND


class AlreadyExistsError(CoreError):
    """What the call would create exists already under another name."""

    code = "ALREADY_EXISTS"
    default_reason = Reason.ALREADY_EXISTS


class FailedPreconditionError(CoreError):
    """The system is not in a state that allows the call."""

    code = "FAILED_PRECONDITION"
    default_reason = Reason.FAILED_PRECONDITION


class InvalidTransition(FailedPreconditionError):
    """A replica state change that the transition table forbids."""

    default_reason = Reason.INVALID_REPLICA_TRANSITION

    def __init__(self, replica_id: str, from_state: str, to_state: str, reason: str = "") -> None:
        why = f" (requested because: {reason})" if reason else ""
        super().__init__(
            f"replica {replica_id!r} cannot go from {from_state} to {to_state}{why}",
            metadata={"replica_id": replica_id, "from_state": from_state, "to_state": to_state})
        self.replica_id = replica_id
        self.from_state = from_state
        self.to_state = to_state


class OutOfOrder(FailedPreconditionError):
    """A step-protocol call arrived while the controller expects another one."""

    default_reason = Reason.STEP_OUT_OF_ORDER

    def __init__(self, called: str, expected: str, global_step: int | None) -> None:
        step = f" for global_step {global_step}" if global_step is not None else ""
        super().__init__(
            f"{called} is out of order: the controller expects {expected}{step} next",
            metadata={"called": called, "expected": expected,
                      "global_step": "" if global_step is None else global_step})
        self.called = called
        self.expected = expected
        self.global_step = global_step


class PolicyError(InvalidArgumentError):
    """A scheduling policy name, import path or parameter set is unusable."""

    default_reason = Reason.INVALID_POLICY


class PortUnavailable(CoreError):
    """A peer (load balancer, agent, trainer) could not be reached; retry-able."""

    code = "UNAVAILABLE"
    default_reason = Reason.PEER_UNAVAILABLE


class PortDeadlineExceeded(CoreError):
    """A call to a peer did not finish within its configured timeout."""

    code = "DEADLINE_EXCEEDED"
    default_reason = Reason.PEER_DEADLINE_EXCEEDED
