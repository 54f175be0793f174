"""Shared fixtures: paths to the tools the tests drive."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
