"""The type check: mypy over the packages listed in pyproject's [tool.mypy] finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def test_the_checked_packages_type_check():
    pytest.importorskip("mypy")
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                            text=True, timeout=280)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def test_the_check_catches_a_type_error(tmp_path):
    pytest.importorskip("mypy")
    bad = tmp_path / "bad.py"
    bad.write_text("def half(n: int) -> int:\n    return n / 2\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--config-file",
                             str(ROOT / "pyproject.toml"), str(bad)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=280)
    assert result.returncode == 1 and "Incompatible return value type" in result.stdout, result.stdout
