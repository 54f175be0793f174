"""The docs' verl example, as a user runs it: ``examples/verl/run.sh`` starts a secure rollmesh fleet
(``rollmesh up --config examples/verl/fleet.yaml``), and verl's own ``fully_async_main``, unedited, trains the
quick start's task with its rollout served by the fleet and its weights committed by the fleet's controller (on
this machine's CPU through ``rollmesh_verl.cpu``)."""

from __future__ import annotations

import re
import subprocess

from tests.processes import clean_env

from .fleet import ROOT


def test_verls_fully_async_main_trains_on_a_rollmesh_fleet():
    run = ROOT / "runs" / "verl"
    done = subprocess.run([str(ROOT / "examples" / "verl" / "run.sh")],
                          capture_output=True, text=True, timeout=420, cwd=ROOT, env=clean_env())
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    steps = [float(s) for s in re.findall(r"training/global_step:([0-9.]+)", out)]
    assert len(steps) >= 2 and steps == sorted(steps), steps
    # every step's version went to the fleet: the trainer agent read them, the older files were deleted
    versions = [int(p.stem) for p in (run / "weights").glob("*.safetensors")]
    assert len(versions) == 1 and versions[0] >= len(steps) - 1, versions
    up = (run / "up.log").read_text()
    assert "replicas routed: 2 of 2" in up
    assert "stopped: lb (exit 0), trainer-agent (exit 0), controller (exit 0), replica-agent (exit 0)" in up
    trainer = (run / "mesh" / "trainer-agent.log").read_text()   # both replicas received the last version
    assert re.search(rf"sent weight version {versions[0]} to 2 receiver", trainer), trainer[-3000:]
