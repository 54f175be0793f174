"""The controller's Mesh is its composition root: it wires each feature its ports, and nothing else in the
controller reaches through a mesh into the members it wired. The RPCs depend on ``ControllerApi`` (which the
Mesh implements; mypy, run by tests/test_types.py, checks that it does), the metrics on their ``Observed``
port, and only the role manager (``leadership.py``) builds meshes."""

from __future__ import annotations

import ast
from pathlib import Path

CONTROLLER = Path(__file__).resolve().parents[2] / "controller"
ROOT = CONTROLLER / "mesh.py"


def _modules() -> list[Path]:
    return sorted(p for p in CONTROLLER.rglob("*.py") if p != ROOT)


def _reaches_through(node: ast.AST) -> bool:
    """``mesh.member.anything`` or ``self.mesh.member.anything`` (``_mesh`` too)."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
        return False
    holder = node.value.value
    name = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(holder, ast.Attribute) else ""
    return name in {"mesh", "_mesh"}


def test_nothing_outside_the_composition_root_reaches_through_a_mesh():
    found = [f"{path.relative_to(CONTROLLER.parent)}:{node.lineno}: {ast.unparse(node)}"
             for path in _modules() for node in ast.walk(ast.parse(path.read_text())) if _reaches_through(node)]
    assert found == []


def test_the_check_sees_a_reach_through():
    assert _reaches_through(ast.parse("self.mesh.registry.replicas()").body[0].value.func)
    assert _reaches_through(ast.parse("mesh.store.read_only = True").body[0].targets[0])
    assert not _reaches_through(ast.parse("self.mesh.start_acting(spawn)").body[0].value.func)
    assert not _reaches_through(ast.parse("self.api.registry.replicas()").body[0].value.func)


def test_only_the_role_manager_builds_meshes():
    importers = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] == "mesh" and node.level:
                importers.add(path.relative_to(CONTROLLER).as_posix())
    assert importers == {"leadership.py"}
