"""``rollmesh status``: a readable summary by default, whole JSON with integers on request, a default port."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(60)


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", "status", *args], capture_output=True,
                          text=True, env=clean_env(), timeout=30)


def test_summary_json_and_default_port(tmp_path):
    with running_server("lb", ["--listen", "127.0.0.1:0"], log_path=tmp_path / "lb.log") as (address, _):
        summary = _status(address)
        assert summary.returncode == 0, summary.stderr
        lines = summary.stdout.splitlines()
        assert lines[0].startswith("lb ") and f"listening on {address}" in lines[0]
        assert "ready: yes" in lines[1] and "transport: plaintext_loopback" in lines[1]
        assert "replica count: 0" in summary.stdout
        raw = _status(address, "--json")
        assert raw.returncode == 0, raw.stderr
        config = json.loads(raw.stdout)["status"]["config"]
        assert config["retry_budget"] == 16 and isinstance(config["retry_budget"], int)   # not 16.0
    bare = _status("127.0.0.1", "--timeout", "1")
    assert "using 127.0.0.1:50051 (the controller's default port)" in bare.stderr
    assert _status("127.0.0.1:x").returncode == 2
