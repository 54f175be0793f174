"""The docs' verl example, as a user runs it: ``examples/verl/run.sh`` starts a secure rollmesh fleet
(``rollmesh up --config examples/verl/fleet.yaml``), and verl's own ``fully_async_main``, unedited, trains the
quick start's task with its rollout served by the fleet and its weights broadcast from verl's rank 0 and committed
by the fleet's controller (on this machine's CPU through ``rollmesh_verl.cpu``)."""

from __future__ import annotations

import re
import subprocess

from tests.processes import clean_env

from .fleet import ROOT


def test_verls_fully_async_main_trains_on_a_rollmesh_fleet():
    run = ROOT / "runs" / "verl"
    logs = {name: run / "mesh" / f"{name}.log" for name in ("controller", "replica-agent")}
    before = {name: path.stat().st_size if path.exists() else 0 for name, path in logs.items()}   # earlier runs'
    done = subprocess.run([str(ROOT / "examples" / "verl" / "run.sh")],
                          capture_output=True, text=True, timeout=420, cwd=ROOT, env=clean_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    steps = [float(s) for s in re.findall(r"training/global_step:([0-9.]+)", out)]
    assert len(steps) >= 2 and steps == sorted(steps), steps
    # every step's version went to both replicas, broadcast from verl's rank 0 (no trainer agent, no file)
    up = (run / "up.log").read_text()
    assert "replicas routed: 2 of 2" in up
    assert "stopped: lb (exit 0), controller (exit 0), replica-agent (exit 0)" in up
    controller, replicas = (logs[name].read_bytes()[before[name]:].decode() for name in logs)
    assert "weight source named by the trainer" in controller, controller[-3000:]
    for replica in ("s0", "s1"):
        served = [int(v) for v in re.findall(rf"replica {replica} now serves weight version (\d+)", replicas)]
        assert served and served == sorted(served) and served[-1] >= len(steps) - 1, (replica, served)
