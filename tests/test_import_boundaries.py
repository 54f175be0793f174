"""The package boundaries of docs/architecture.md (conventions, rule 12), checked on every import statement.

- servers (controller, loadbalancer, replica_agent, trainer_agent) never import each other;
- the shared runtime (mesh_runtime) imports no server, no tool and nothing that needs torch;
- the shared model packages (weight_transfer, modeling) import no server and no tool;
- the controller and the load balancer import nothing that needs torch (they run no model);
- the simulator uses the controller core only; the launcher is the one package above several servers;
- the client library for custom trainers (trainer_client) uses the runtime only: no server, no torch;
- the verl plugin (rollmesh_verl, in integrations/verl, run inside verl's environment) uses the runtime, the client
  library and the model-shared packages, and of the servers one module: the trainer's weight sender
  (trainer_agent.in_process, rank 0 serving its own weights), which loads no driver, no engine and no transformers
  (checked in a fresh interpreter); so no engine code in verl's processes.

Every ``import`` / ``from ... import`` counts, also inside functions: a lazy import is still a
dependency, and so is ``importlib.import_module("name")`` (the ``rollmesh`` command, which finds every server
and tool by name, is in the launcher for that reason). A second check imports the runtime and the two model-free servers in a fresh
interpreter and asserts torch and transformers were not loaded.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {"controller", "loadbalancer", "replica_agent", "trainer_agent"}
RUNTIME = {"mesh_runtime"}
MODEL_SHARED = {"weight_transfer", "modeling"}
TOOLS = {"simulator", "launcher"}
CLIENTS = {"trainer_client"}
PLUGINS = {"rollmesh_verl"}
TORCH = {"torch", "transformers", "safetensors"} | MODEL_SHARED
OURS = SERVERS | RUNTIME | MODEL_SHARED | TOOLS | CLIENTS | PLUGINS
PACKAGE_DIRS = {"rollmesh_verl": "integrations/verl/rollmesh_verl"}
"""Packages that do not sit at the repository's top level."""

ALLOWED: dict[str, set[str]] = {
    "mesh_runtime": RUNTIME,
    "weight_transfer": RUNTIME | {"weight_transfer"},
    "modeling": RUNTIME | {"modeling"},
    "controller": RUNTIME | {"controller"},
    "loadbalancer": RUNTIME | {"loadbalancer"},
    "replica_agent": RUNTIME | MODEL_SHARED | {"replica_agent"},
    "trainer_agent": RUNTIME | MODEL_SHARED | CLIENTS | {"trainer_agent"},   # its driver calls as a client does
    "simulator": RUNTIME | {"simulator", "controller"},
    "launcher": OURS,
    "trainer_client": RUNTIME | {"trainer_client"},
    "rollmesh_verl": RUNTIME | CLIENTS | MODEL_SHARED | {"rollmesh_verl"},
}
"""Top-level packages of ours each package may import."""

ALLOWED_MODULES: dict[str, set[str]] = {"rollmesh_verl": {"trainer_agent.in_process"}}
"""Single modules of another layer a package may import (what they load is checked below)."""

NO_TORCH = {"mesh_runtime", "controller", "loadbalancer", "simulator", "trainer_client"}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module_parts = path.relative_to(ROOT).with_suffix("").parts
    for package, directory in PACKAGE_DIRS.items():   # a package's dotted name, wherever its directory is
        if path.is_relative_to(ROOT / directory):
            module_parts = (package, *path.relative_to(ROOT / directory).with_suffix("").parts)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: drop the module's own name, then one package per extra dot
                base = module_parts[:len(module_parts) - node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and _names_module(node):
            found.append((node.lineno, node.args[0].value))
    return found


def _names_module(call: ast.Call) -> bool:
    """``importlib.import_module("a.b")`` / ``import_module("a.b")`` with a literal name: an import too."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return (name in ("import_module", "__import__") and bool(call.args) and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str))


def _violations() -> list[str]:
    problems = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / PACKAGE_DIRS.get(package, package)).rglob("*.py")):
            for line, name in _imports(path):
                top = name.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{line} imports {name}"
                if top in OURS and top not in allowed and name not in ALLOWED_MODULES.get(package, ()):
                    problems.append(f"{where} ({package} may import {', '.join(sorted(allowed))})")
                if package in NO_TORCH and top in TORCH:
                    problems.append(f"{where} ({package} must not need torch)")
    return problems


def test_every_package_imports_only_what_its_layer_allows():
    assert _violations() == []


def test_the_checker_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    for package in ALLOWED:
        (tmp_path / PACKAGE_DIRS.get(package, package)).mkdir(parents=True)
    (tmp_path / "loadbalancer" / "bad.py").write_text(
        "def f():\n    from replica_agent.engines import types\n    import torch\n")
    (tmp_path / "mesh_runtime" / "hidden.py").write_text(
        "import importlib\ndef f(name):\n    importlib.import_module('loadbalancer.server')\n"
        "    importlib.import_module(name)\n")
    (tmp_path / "mesh_runtime" / "sub").mkdir()
    (tmp_path / "mesh_runtime" / "sub" / "x.py").write_text("from ...controller import core\nfrom .. import config\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = _violations()
    assert any("bad.py:2 imports replica_agent.engines" in p for p in problems)
    assert any("bad.py:3 imports torch (loadbalancer must not need torch)" in p for p in problems)
    assert any("x.py:1 imports controller (" in p for p in problems)            # resolved relative import
    assert any("hidden.py:3 imports loadbalancer.server" in p for p in problems)  # import_module by name
    assert not any("imports mesh_runtime" in p for p in problems)               # ".." stays in the runtime
    assert len(problems) == 4


def test_the_runtime_and_the_model_free_servers_load_without_torch():
    modules = sorted({f"mesh_runtime.{p.stem}" for p in (ROOT / "mesh_runtime").glob("*.py") if p.stem != "__init__"})
    modules += ["controller.server", "launcher.cli", "launcher.top", "loadbalancer.server", "simulator.cli"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "loaded = sorted(m for m in ('torch', 'transformers', 'weight_transfer', 'modeling') if m in sys.modules)\n"
            "print(','.join(loaded))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"loaded without need: {result.stdout.strip()}"


def test_the_controller_core_and_the_error_base_load_without_grpc():
    """The core is I/O-free and the engines know no gRPC, yet both raise the mesh's errors: the error base
    (mesh_runtime.failures) and everything they import load without grpc."""
    modules = sorted(f"controller.core.{p.stem}" for p in (ROOT / "controller" / "core").glob("*.py")
                     if p.stem != "__init__")
    modules += ["mesh_runtime.failures", "replica_agent.engines.errors"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "print(','.join(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"grpc loaded by: {result.stdout.strip()[:300]}"


MAX_MODULE_LINES = 520   # "about 500": a module that grows past it is split along what it owns


def test_no_module_outgrows_one_concern():
    skip = {"generated", ".venv", ".venv-gpu-pins", ".venv-verl", "node_modules", "third_party", ".git"}
    long = [f"{path.relative_to(ROOT)}: {n} lines"
            for path in ROOT.rglob("*.py") if not skip & set(path.relative_to(ROOT).parts)
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "split these modules:\n" + "\n".join(long)


def test_the_trainers_weight_sender_loads_no_driver_engine_or_transformers():
    """What the verl plugin may import of the trainer agent (ALLOWED_MODULES) stays the broadcast alone."""
    code = ("import sys\nimport trainer_agent.in_process\n"
            "print(','.join(sorted(m for m in sys.modules if m.startswith(('trainer_agent.driver', "
            "'trainer_agent.training', 'trainer_agent.megatron', 'replica_agent', 'transformers')))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"loaded: {result.stdout.strip()}"
