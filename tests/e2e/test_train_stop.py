"""Ctrl-C ends ``rollmesh train`` cleanly after the trainer's current step (StopTraining), end to end on CPU.

A quick-start run of many steps gets one SIGINT once its trainer has
reported step ``N``: the run must end as a finished one does, only earlier:
exit 0, the stop step announced, the steps up to it trained once each, a
checkpoint at that step, the trained model written, the summary saying it
stopped early, every process gone.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.job_configs import job_config
from tests.e2e.test_train_resume import _alive, _finish, _lines, _reported_step, _train

pytestmark = pytest.mark.timeout(360)

STOP_AFTER = 2    # SIGINT once the trainer reported this step
CEILING = 200     # the run's total_training_steps: far more than it may train


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-stop")
    run_dir = tmp / "run"
    config = job_config(tmp, "quickstart.yaml", "long.yaml", **{"trainer.total_training_steps": CEILING})
    proc = _train("--config", str(config), "--run-dir", str(run_dir))
    steps_file = run_dir / "trainer" / "steps.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and _reported_step(steps_file) < STOP_AFTER:
        time.sleep(0.1)
    assert _reported_step(steps_file) >= STOP_AFTER, _finish(proc, 60)[1][-4000:]
    pids = {n: p["pid"] for n, p in json.loads((run_dir / "processes.json").read_text()).items()}
    proc.send_signal(signal.SIGINT)
    code, output = _finish(proc, timeout_s=180)
    return {"code": code, "output": output, "dir": run_dir, "alive": [n for n, pid in pids.items() if _alive(pid)],
            "lines": _lines(steps_file), "metrics": json.loads((run_dir / "metrics.json").read_text())}


def test_one_ctrl_c_ends_the_run_after_its_current_step_as_a_normal_end(stopped):
    assert stopped["code"] == 0, stopped["output"][-4000:]
    assert not stopped["alive"]
    lines = stopped["lines"]
    requested = [line for line in lines if line["event"] == "stop_requested"]
    assert len(requested) == 1
    final = requested[0]["final_step"]
    assert STOP_AFTER < final < CEILING
    assert f"ending after step {final}" in stopped["output"]
    assert [line["global_step"] for line in lines if line["event"] == "step"] == list(range(1, final + 1))
    assert lines[-1] == {"event": "finished", "steps": final}
    assert any(line["event"] == "model_written" and line["weight_version"] == final for line in lines)
    summary = stopped["metrics"]["summary"]
    assert summary["state"] == "FINISHED" and summary["steps"] == final
    assert summary["stopped_after_step"] == final and summary["final_weight_version"] == final
    assert f"after step {final} (StopTraining)" in stopped["output"]


def test_the_stopped_run_leaves_a_checkpoint_at_its_last_step(stopped):
    from trainer_agent.driver.checkpoint import checkpoint_info

    info = checkpoint_info(Path(stopped["dir"]) / "checkpoint")
    final = stopped["metrics"]["summary"]["steps"]
    assert info is not None and info.global_step == final and info.weight_version == final
    assert info.generated == info.consumed + info.dropped + info.queue_size
