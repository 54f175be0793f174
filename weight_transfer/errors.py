"""Errors raised by the weight-broadcast transfer.

Each error is a :class:`mesh_runtime.errors.RollmeshError` of the canonical
code a caller should report, so a servicer that lets one escape gets the
right status and an ``ErrorInfo`` reason without mapping it by hand:

========================  ====================  ===========================
error                     canonical code        reason
========================  ====================  ===========================
``InvalidManifest``       INVALID_ARGUMENT      WEIGHT_MANIFEST_INVALID
``ManifestMismatch``      FAILED_PRECONDITION   WEIGHT_MANIFEST_MISMATCH
``GroupClosed``           FAILED_PRECONDITION   WEIGHT_GROUP_CLOSED
``ChecksumMismatch``      UNAVAILABLE           WEIGHT_CHECKSUM_MISMATCH
``NotAuthentic``          UNAVAILABLE           WEIGHTS_NOT_AUTHENTIC
``TransferTimeout``       UNAVAILABLE           WEIGHT_TRANSFER_TIMEOUT
``PeerLost``              UNAVAILABLE           WEIGHT_PEER_LOST
``TransferCancelled``     ABORTED               WEIGHT_TRANSFER_CANCELLED
``GroupBusy``             ABORTED               WEIGHT_GROUP_BUSY
========================  ====================  ===========================

``ChecksumMismatch`` and ``NotAuthentic`` are both ``VerificationFailed``:
the bytes arrived but must not be used. The UNAVAILABLE ones are worth retrying as a new sync (with a new group id:
see :mod:`weight_transfer.groups`); the others are not.
"""

from __future__ import annotations

from mesh_runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    RollmeshError,
    Unavailable,
)
from mesh_runtime.reasons import Reason


class WeightTransferError(RollmeshError):
    """Base class of every error this package raises."""


class InvalidManifest(WeightTransferError, InvalidArgument):
    """A manifest (or its dict form) is malformed or internally inconsistent."""

    default_reason = Reason.WEIGHT_MANIFEST_INVALID


class ManifestMismatch(WeightTransferError, FailedPrecondition):
    """The manifest does not describe the tensors it is used with.

    Raised by :func:`validate_against` before any byte moves, and by the sender
    when its tensors differ from the manifest. ``tensor_name`` names the first
    offending tensor.
    """

    default_reason = Reason.WEIGHT_MANIFEST_MISMATCH

    def __init__(self, message: str, *, tensor_name: str = "") -> None:
        super().__init__(message, metadata={"tensor": tensor_name} if tensor_name else None)
        self.tensor_name = tensor_name


class GroupClosed(WeightTransferError, FailedPrecondition):
    """The process group was closed, evicted or broken by an earlier failure."""

    default_reason = Reason.WEIGHT_GROUP_CLOSED


class VerificationFailed(WeightTransferError, Unavailable):
    """The received weights are not the ones the plan describes; nothing received may be used."""

    default_reason = Reason.WEIGHT_VERIFICATION_FAILED


class NotAuthentic(VerificationFailed):
    """An authenticated broadcast failed its check: the sender's manifest tag does not match the plan's key and
    manifest, or a bucket's bytes do not hash to the manifest's digest of that bucket."""

    default_reason = Reason.WEIGHTS_NOT_AUTHENTIC


class DeltaRefused(VerificationFailed):
    """A received delta cannot be applied: its indices are out of range or out of order, or its bitmap and
    values disagree. Nothing is swapped in."""


class ChecksumMismatch(VerificationFailed):
    """The received bytes do not hash to the manifest's checksum."""

    default_reason = Reason.WEIGHT_CHECKSUM_MISMATCH

    def __init__(self, expected: str, actual: str, algorithm: str) -> None:
        super().__init__(f"{algorithm} checksum of the received weights is {actual}, "
                         f"the manifest says {expected}",
                         metadata={"expected": expected, "actual": actual, "algorithm": algorithm})
        self.expected = expected
        self.actual = actual
        self.algorithm = algorithm


class TransferTimeout(WeightTransferError, Unavailable):
    """A peer did not show up or did not answer within the configured timeout."""

    default_reason = Reason.WEIGHT_TRANSFER_TIMEOUT


class PeerLost(WeightTransferError, Unavailable):
    """A peer closed its connection (crashed, or gave up after its own timeout)."""

    default_reason = Reason.WEIGHT_PEER_LOST


class TransferCancelled(WeightTransferError, Aborted):
    """The caller cancelled the transfer; the group it ran on is now closed."""

    default_reason = Reason.WEIGHT_TRANSFER_CANCELLED


class GroupBusy(WeightTransferError, Aborted):
    """Another transfer is already running on the same group."""

    default_reason = Reason.WEIGHT_GROUP_BUSY
