"""The reasons of rollmesh's errors, from the contract (``rollmesh.common.v1.ErrorReason``).

:class:`Reason` is a string enum built from the contract's enum, so the
contract is the one list: ``Reason.REPLICA_NOT_SERVING == "REPLICA_NOT_SERVING"``,
the ``google.rpc.ErrorInfo.reason`` on the wire. Every error raised on
purpose names one (``reason=Reason.<NAME>``); a name not in the contract is an
``AttributeError`` where it is written, and ``tests/mesh_runtime/test_error_reasons.py``
checks that every name the code uses exists and every value is used.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from rollmesh.common.v1 import errors_pb2

_NAMES = [name for name in errors_pb2.ErrorReason.keys() if name != "ERROR_REASON_UNSPECIFIED"]

if TYPE_CHECKING:
    Reason: Any   # built at run time from the contract; tests/mesh_runtime/test_error_reasons.py checks the names used
else:
    Reason = enum.StrEnum("Reason", [(name, name) for name in _NAMES], module=__name__)
    """Every reason of the contract's ErrorReason, as strings."""


def known(reason: str) -> bool:
    """Whether ``reason`` is one of the contract's reasons."""
    return reason in Reason.__members__
