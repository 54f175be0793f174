"""Shared fixtures: paths to the tools the tests drive, and a verl-shaped checkout on sys.path; and the
``slow`` mark on every test of a module that starts processes (``scripts/test --fast`` leaves them out)."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest

from tests import verl_shaped

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / "node_modules" / ".bin" / "buf"

# What a test module that starts processes uses: the launcher's or the tests' process helpers, subprocess,
# network namespaces, a real etcd, node. Such modules form the slow tier; the rest runs in-process.
STARTS_PROCESSES = re.compile(r"\bstart_server\(|\bsubprocess\b|create_subprocess_exec|tests\.processes|"
                              r"tests\.multihost|tests\.etcd_server|launcher\.processes|\bPopen\(|"
                              r"tests\.controller\.scaling\.helpers|tests\.weights\.helpers|fake_sglang")


@functools.cache
def _starts_processes(path: Path) -> bool:
    return bool(STARTS_PROCESSES.search(path.read_text(encoding="utf-8")))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and _starts_processes(Path(str(item.fspath))):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def buf() -> Path:
    if not BUF.exists():
        pytest.skip("node_modules/.bin/buf is missing: run scripts/install (npm ci)")
    return BUF


@pytest.fixture(scope="session")
def node() -> str:
    path = shutil.which("node")
    if path is None or not (ROOT / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.skip("node or node_modules/@grpc/grpc-js is missing: run scripts/install")
    return path


@pytest.fixture
def verl_root(tmp_path, monkeypatch):
    """A verl-shaped package (``tests/verl_shaped.py``) written to a temporary checkout on ``sys.path``."""
    root = verl_shaped.write_verl_package(tmp_path / "verl-checkout")
    monkeypatch.syspath_prepend(str(root))
    verl_shaped.forget_verl_modules()
    yield root
    verl_shaped.forget_verl_modules()


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A throwaway mesh CA with a certificate ``<role>-n0`` for every role (tests/security/pki.py)."""
    from tests.security.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
