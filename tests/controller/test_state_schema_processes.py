"""A controller given a state store written by a newer release exits naming the document, instead of misreading it."""

from __future__ import annotations

import json
import subprocess

import pytest

from controller.store import StateStore
from launcher.processes import server_command
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(60)


def test_a_store_of_a_newer_schema_stops_the_controller_with_what_to_do(tmp_path):
    store = StateStore(str(tmp_path / "state"))
    assert store.backend is not None
    store.backend.write([("scheduler", json.dumps({"schema_version": 7, "current_step": 4}))], [], [])
    store.close()
    config = tmp_path / "controller.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\n")
    proc = subprocess.run(server_command("controller", ["--config", str(config), "--listen", "127.0.0.1:0"]),
                          capture_output=True, text=True, timeout=45, env=clean_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("rollmesh controller: error: state document 'scheduler' has schema version 7, newer than this "
            "controller's 1" in proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    again = StateStore(str(tmp_path / "state"))
    assert again.backend is not None
    assert json.loads(again.backend.load("scheduler") or "{}")["schema_version"] == 7   # left as it was
