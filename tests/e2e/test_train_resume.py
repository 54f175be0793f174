"""``rollmesh train --resume`` end to end on CPU: interrupt a real run, then continue it in place.

One short quick-start run is interrupted (SIGTERM, as a scheduler's kill:
no clean end, unlike a first Ctrl-C) once its trainer has reported step
``N``; every process must stop. The
checkpoint it left is read, then ``--resume`` continues the run in the same
directory up to ``TARGET`` steps with a freshly started mesh. The tests read
the run directory: steps continue after the checkpoint's step with no gap or
repeat, weight versions continue, the samples queued at the checkpoint are
consumed (the sample counters continue from the checkpoint's), every replica
holds the trainer's version before the resumed run generates and after each
sync, and the files were appended to. The refusals (no checkpoint, another
model or task, steps already reached) are checked against the same directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from tests.e2e.job_configs import job_config
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
INTERRUPT_AFTER = 2  # N: SIGTERM once the trainer reported this step
TARGET = 5  # steps of the resumed run's config
REQUIRED = 8 * 8  # ppo_mini_batch_size x require_batches x rollout.n in the quick start
STANDALONE = ("s0-0", "s0-1")


def _train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=clean_env(GLOO_SOCKET_IFNAME="lo"), cwd=ROOT,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError("rollmesh train did not finish in time:\n" + out.decode()[-4000:]) from None
    return proc.returncode, out.decode(errors="replace")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split(") ")[-1].split()[0] != "Z"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reported_step(steps_file: Path) -> int:
    if not steps_file.exists():
        return 0
    return max((int(s["global_step"]) for s in _lines(steps_file) if s.get("event") == "step"), default=0)


class Resumed:
    """The interrupted run, its checkpoint, and the resumed run, all in one directory."""

    def __init__(self, tmp: Path) -> None:
        from trainer_agent.driver.checkpoint import checkpoint_info

        self.tmp, self.dir = tmp, tmp / "run"
        self.config = job_config(tmp, "quickstart.yaml", "long.yaml", **{"trainer.total_training_steps": 200})
        proc = _train("--config", str(self.config), "--run-dir", str(self.dir))
        steps_file = self.dir / "trainer" / "steps.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and \
                _reported_step(steps_file) < INTERRUPT_AFTER:
            time.sleep(0.1)
        assert _reported_step(steps_file) >= INTERRUPT_AFTER, _finish(proc, 60)[1][-4000:]
        self.first_pids = {n: p["pid"] for n, p in json.loads((self.dir / "processes.json").read_text()).items()}
        proc.send_signal(signal.SIGTERM)
        self.first_code, self.first_output = _finish(proc, timeout_s=120)
        self.first_alive = [n for n, pid in self.first_pids.items() if _alive(pid)]
        self.first_events = _lines(self.dir / "events.jsonl")
        self.first_step_lines = _lines(steps_file)
        self.checkpoint = checkpoint_info(self.dir / "checkpoint")

        self.resume_config = job_config(tmp, "quickstart.yaml", "resume.yaml",
                                        **{"trainer.total_training_steps": TARGET})
        self.code, self.output = _finish(_train("--config", str(self.resume_config), "--resume", str(self.dir)))
        self.events = _lines(self.dir / "events.jsonl")
        self.step_lines = _lines(steps_file)
        self.metrics = json.loads((self.dir / "metrics.json").read_text())
        pids = {n: p["pid"] for n, p in json.loads((self.dir / "processes.json").read_text()).items()}
        self.alive = [n for n, pid in pids.items() if _alive(pid)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Resumed:
    return Resumed(tmp_path_factory.mktemp("train-resume"))


def _after_resume(run: Resumed) -> list[dict]:
    """The lines the resumed run appended to steps.jsonl."""
    return run.step_lines[len(run.first_step_lines):]


def test_sigterm_stops_every_process_and_leaves_a_checkpoint(run):
    assert run.first_code == 130, run.first_output[-3000:]
    assert "interrupted" in run.first_output
    assert not run.first_alive
    ckpt = run.checkpoint
    assert ckpt is not None and ckpt.global_step >= INTERRUPT_AFTER
    assert ckpt.weight_version == ckpt.global_step  # one GRPO update per global step in the quick start
    assert ckpt.generated == ckpt.consumed + ckpt.dropped + ckpt.queue_size
    assert ckpt.consumed == ckpt.global_step * REQUIRED
    assert ckpt.job["model"] == "tiny-llama" and ckpt.job["rollout_n"] == 8


def test_the_resumed_run_finishes_and_its_steps_continue_without_gap_or_repeat(run):
    assert run.code == 0, run.output[-5000:]
    assert not run.alive and "stopped: " in run.output
    k = run.checkpoint.global_step
    new = _after_resume(run)
    assert new[0]["event"] == "resumed" and new[0]["global_step"] == k
    assert [s["global_step"] for s in new if s["event"] == "step"] == list(range(k + 1, TARGET + 1))
    assert new[-1] == {"event": "finished", "steps": TARGET}
    # The whole run, as the summary counts it: steps 1..TARGET once each (a step the interrupted run
    # finished after its last checkpoint, if any, is done again and its first line superseded).
    from launcher.train_report import effective_steps

    steps = effective_steps(run.step_lines)
    assert [s["global_step"] for s in steps] == list(range(1, TARGET + 1))
    assert [s["weight_version"] for s in steps] == list(range(1, TARGET + 1))
    assert all(s["trainer_param_version"] == s["weight_version"] for s in steps)
    summary = run.metrics["summary"]
    assert summary["steps"] == TARGET and summary["resumed_at_step"] == k and summary["state"] == "FINISHED"
    assert summary["reward"]["first"] == steps[0]["reward_mean"]  # step 1 of the first run
    assert f"only since resume at step {k}" in run.output and "reward, step 1 -> last" in run.output


def test_the_samples_queued_at_the_checkpoint_are_consumed_and_the_counters_continue(run):
    ckpt, new = run.checkpoint, _after_resume(run)
    resumed = new[0]
    assert (resumed["queue_size"], resumed["generated"], resumed["consumed"], resumed["dropped"]) == (
        ckpt.queue_size, ckpt.generated, ckpt.consumed, ckpt.dropped)
    steps = [s for s in new if s["event"] == "step"]
    previous_consumed = ckpt.consumed
    for s in steps:
        assert s["consumed"] == previous_consumed + s["step_consumed"] == previous_consumed + REQUIRED
        assert s["generated"] == s["consumed"] + s["dropped"] + s["queue_size"]
        previous_consumed = s["consumed"]
    assert steps[0]["generated"] >= ckpt.generated and steps[0]["dropped"] >= ckpt.dropped
    # The queue is FIFO and evicts from its front: while nothing was dropped, the samples that were queued
    # at the checkpoint (its front) are the first the resumed steps consumed.
    covering = next(s for s in steps if s["consumed"] - ckpt.consumed >= ckpt.queue_size)
    assert covering["dropped"] == ckpt.dropped
    s = run.metrics["summary"]["samples"]
    assert s["samples_consumed"] == TARGET * REQUIRED
    assert s["samples_generated"] == s["samples_consumed"] + s["samples_dropped"] + s["queue_size"]


def test_every_replica_holds_the_trainers_version_before_generation_and_after_each_sync(run):
    k, v = run.checkpoint.global_step, run.checkpoint.weight_version
    new = _after_resume(run)
    synced = [s for s in new if s["event"] == "replicas_synced"]
    assert len(synced) == 1 and new.index(synced[0]) == 1  # right after the restore, before any step
    assert synced[0]["weight_version"] == v
    assert synced[0]["replicas"] == {"s0-0": v, "s0-1": v, "h0": v}
    first_step = next(s for s in new if s["event"] == "step")
    assert synced[0]["time"] <= min(a["start"] for a in first_step["activities"])
    for s in (s for s in new if s["event"] == "step"):
        active = {rid: r for rid, r in s["replicas"].items() if r["state"] == "REPLICA_STATE_ACTIVE"}
        assert set(STANDALONE) <= set(active), s["replicas"]
        assert {r["weight_version"] for r in active.values()} == {s["weight_version"]}
    # The new controller's log: the resume sync to version v, before step k + 1 began.
    resumed_events = [e for e in run.events if e.get("resumed_at_step") == k]
    assert resumed_events and len(run.events) == len(run.first_events) + len(resumed_events)
    first_phase = next(i for i, e in enumerate(resumed_events) if e["type"] == "STEP_PHASE")
    assert resumed_events[first_phase]["global_step"] == k + 1
    assert any(e["type"] == "WEIGHT_SYNC_COMPLETED" and e["weight_version"] == v
               for e in resumed_events[:first_phase])
    completed = {e["weight_version"] for e in resumed_events if e["type"] == "WEIGHT_SYNC_COMPLETED"}
    assert completed == set(range(v, TARGET + 1))


def test_resuming_again_is_refused_once_the_steps_are_reached(run, capsys):
    assert cli_main(["train", "--config", str(run.resume_config), "--resume", str(run.dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"already reached step {TARGET}" in err, err


@pytest.mark.parametrize("changes, named", [
    ({"model": "tiny-qwen2"}, "model 'tiny-qwen2'"),
    ({"task.radix": 8}, "task.radix 8"),
    ({"actor_rollout_ref.rollout.n": 4}, "actor_rollout_ref.rollout.n 4"),
])
def test_a_config_that_cannot_continue_the_checkpoint_is_refused(run, capsys, changes, named):
    config = job_config(run.tmp, "quickstart.yaml", "changed.yaml",
                        **{"trainer.total_training_steps": TARGET + 5, **changes})
    before = (run.dir / "trainer" / "steps.jsonl").read_text()
    assert cli_main(["train", "--config", str(config), "--resume", str(run.dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert (run.dir / "trainer" / "steps.jsonl").read_text() == before  # nothing started


def test_a_directory_without_a_checkpoint_is_refused(tmp_path, capsys):
    config = job_config(tmp_path, "quickstart.yaml", "q.yaml")
    (tmp_path / "empty").mkdir()
    assert cli_main(["train", "--config", str(config), "--resume", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no checkpoint" in err, err


def test_a_resumed_line_supersedes_the_steps_done_after_the_checkpoint():
    """A run stopped between a step's line and its checkpoint resumes at that step again; its first line goes."""
    from launcher.train_report import effective_steps

    lines = [{"event": "step", "global_step": 1, "reward_mean": 0.1}, {"event": "step", "global_step": 2},
             {"event": "step", "global_step": 3, "reward_mean": 0.5},  # checkpoint of step 3 never written
             {"event": "resumed", "global_step": 2}, {"event": "replicas_synced", "global_step": 2},
             {"event": "step", "global_step": 3, "reward_mean": 0.3}, {"event": "step", "global_step": 4},
             {"event": "finished", "steps": 4}]
    steps = effective_steps(lines)
    assert [s["global_step"] for s in steps] == [1, 2, 3, 4]
    assert steps[2]["reward_mean"] == 0.3
