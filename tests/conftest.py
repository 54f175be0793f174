"""Shared fixtures: paths to the tools the tests drive, and a verl-shaped checkout on sys.path."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import verl_shaped

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / "node_modules" / ".bin" / "buf"


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
