"""Every error reason is in the contract (rollmesh.common.v1.ErrorReason), and the code uses the enum."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh_runtime.errors import FailedPrecondition, InvalidArgument, to_status
from mesh_runtime.reasons import Reason, known
from rollmesh.common.v1 import errors_pb2

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mesh_runtime", "controller", "loadbalancer", "replica_agent", "trainer_agent", "trainer_client",
            "launcher", "weight_transfer", "modeling", "simulator")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_the_code_names_only_reasons_of_the_contract():
    used, unknown = set(), []
    for path, text in _sources().items():
        for name in re.findall(r"\bReason\.([A-Z][A-Z0-9_]*)\b", text):
            used.add(name)
            if not known(name):
                unknown.append(f"{path}: Reason.{name}")
    assert not unknown, unknown
    # and every reason of the contract is raised somewhere: the enum lists what exists, nothing more
    assert set(Reason.__members__) - used == set()


def test_no_reason_is_a_bare_string():
    # keyword arguments (reason="X") and class attributes (reason = "X", default_reason = "X")
    literal = re.compile(r"(?<![.\w])(?:reason|default_reason)=\"[A-Z][A-Z0-9_]+\""
                         r"|^\s+(?:default_)?reason(?:: str)? = \"[A-Z][A-Z0-9_]+\"$", re.M)
    found = [f"{path}: {m.group(0).strip()}" for path, text in _sources().items() for m in literal.finditer(text)]
    assert not found, found


def test_the_enum_is_the_wire_string_and_unknown_reasons_are_refused():
    assert Reason.REPLICA_NOT_SERVING == "REPLICA_NOT_SERVING"
    assert errors_pb2.ErrorReason.Name(errors_pb2.REPLICA_NOT_SERVING) == Reason.REPLICA_NOT_SERVING
    status = to_status(FailedPrecondition("busy", reason=Reason.REPLICA_NOT_SERVING))
    assert b"REPLICA_NOT_SERVING" in dict(status.trailing_metadata)["grpc-status-details-bin"]
    assert InvalidArgument("x").reason == Reason.INVALID_ARGUMENT
    with pytest.raises(ValueError, match="NOT_A_REASON"):
        InvalidArgument("x", reason="NOT_A_REASON")
