"""``rollmesh train`` end to end on CPU: the whole mesh as processes, two real training runs.

Run A is the README's first command exactly as written (``scripts/quickstart``
from the repository root, its default run directory); it shows steps 1-2 of the
reference's figure: the hybrid replica joins rollout while the trainer waits and
sleeps before each training step. Run B (``examples/hybrid_skips.yaml``, run from
another directory with the default run directory) shows step 3: the standalone
replicas keep up, the hybrid replica skips rollout and its weight sync; in run B
one rollout node's replica agent is killed mid-run and training still finishes
without losing a sample. Each run is shared by the tests that read its run
directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from tests.e2e.job_configs import job_config
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
STEPS = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())["trainer"]["total_training_steps"]
SKIP_STEPS = 16   # the hybrid_skips run (with a replica agent killed mid-run)
REQUIRED = 8 * 8  # ppo_mini_batch_size x require_batches x rollout.n in both example configs
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(config: Path, run_dir: Path | None, cwd: Path = ROOT) -> subprocess.Popen:
    """``rollmesh train --config CONFIG [--run-dir RUN_DIR]`` run in ``cwd``."""
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "train", "--config", str(config),
                             *(["--run-dir", str(run_dir)] if run_dir is not None else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=clean_env(GLOO_SOCKET_IFNAME="lo"), cwd=cwd, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 360) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        raise AssertionError("rollmesh train did not finish in time:\n" + out.decode()[-4000:]) from None
    return proc.returncode, out.decode(errors="replace")


class Run:
    def __init__(self, run_dir: Path, code: int, output: str) -> None:
        self.dir, self.code, self.output = run_dir, code, output
        assert code == 0, output[-5000:]
        self.events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        lines = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
        self.steps = [line for line in lines if line["event"] == "step"]
        self.metrics = json.loads((run_dir / "metrics.json").read_text())
        self.summary = self.metrics["summary"]


def _quickstart() -> subprocess.Popen:
    """The README's first command as written: ``scripts/quickstart``, no flags, from the repository root (its
    default run directory, ``runs/quickstart-<time>``). Under another virtual environment than the project's
    (the pinned dependency sets' leg, ``scripts/test --pins``) the same job from that environment's CLI."""
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        command = [str(ROOT / "scripts" / "quickstart")]
    else:
        command = [sys.executable, "-m", "launcher.cli", "train", "--config", "examples/quickstart.yaml"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=clean_env(GLOO_SOCKET_IFNAME="lo"), cwd=ROOT, start_new_session=True)


def run_dir_of(output: str) -> Path:
    """The run directory ``rollmesh train`` printed (``events: DIR/events.jsonl``)."""
    found = re.search(r"^events: (\S+)/events\.jsonl", output, re.MULTILINE)
    assert found, output[-3000:]
    return Path(found.group(1))


@pytest.fixture(scope="module")
def hybrid_run() -> Iterator[Run]:
    code, out = _finish(_quickstart())
    run_dir = run_dir_of(out)
    try:
        assert run_dir.parent == ROOT / "runs" and run_dir.name.startswith("quickstart-"), run_dir
        yield Run(run_dir, code, out)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def skip_run_with_a_kill(tmp_path_factory) -> tuple[Run, str]:
    tmp = tmp_path_factory.mktemp("train-skip")
    config = job_config(tmp, "hybrid_skips.yaml", **{"trainer.total_training_steps": SKIP_STEPS})
    work = tmp / "elsewhere"   # run from another directory than the repository's, with the default run directory
    work.mkdir()
    proc = _train(config, None, cwd=work)
    deadline = time.monotonic() + 240
    # Kill as step 3's weight sync starts: the worst moment, when the dead agent's replica is in the
    # broadcast group with the healthy one (the driver then syncs the healthy one again on its own).
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((work / "runs").glob("hybrid_skips-*/events.jsonl"))
        if found and any('"WEIGHT_SYNC_STARTED"' in line and '"global_step": 3' in line
                         for line in found[0].read_text().splitlines()):
            break
        time.sleep(0.005)
    (run_dir,) = (work / "runs").glob("hybrid_skips-*")
    processes = json.loads((run_dir / "processes.json").read_text())
    os.kill(processes["rollout-1"]["pid"], signal.SIGKILL)  # the replica agent dies without a goodbye
    code, out = _finish(proc)
    assert run_dir_of(out) == run_dir
    return Run(run_dir, code, out), "s1-0"


# -- run A: the hybrid replica helps ------------------------------------------------------------------


@pytest.mark.pins
def test_the_reward_rises(hybrid_run):
    """The quick start visibly learns: from near 0 to most of the way (measured 0.79-0.97 at the end for
    model seeds 0-4; the threshold leaves room for a run that learns one kind of answer only)."""
    rewards = [s["reward_mean"] for s in hybrid_run.steps]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert first < 0.25 and last >= 0.45 and last >= first + 0.3, rewards
    # the engine and the trainer compute the same model: at step 1 every sample is on-policy
    assert hybrid_run.steps[0]["metrics"]["actor/rollout_logprob_abs_diff"] <= 1e-3
    assert hybrid_run.steps[0]["metrics"]["actor/on_policy_logprob_abs_diff"] <= 1e-3
    assert "reward, step 1 -> last" in hybrid_run.output
    assert all("reward_extra/chars_of_kind" in s["metrics"] for s in hybrid_run.steps)
    from PIL import Image

    curve = json.loads(Image.open(hybrid_run.dir / "reward.png").text["rollmesh:reward"])
    assert curve["reward"] == rewards and curve["steps"] == list(range(1, STEPS + 1))
    assert curve["hybrid_activated"] == [s["global_step"] for s in hybrid_run.steps if s["hybrid_activated"]]


@pytest.mark.pins
def test_every_generated_sample_is_consumed_dropped_or_still_queued(hybrid_run):
    s = hybrid_run.summary["samples"]
    assert s["samples_generated"] == s["samples_consumed"] + s["samples_dropped"] + s["queue_size"]
    assert s["samples_consumed"] == STEPS * REQUIRED
    assert all(step["step_consumed"] == REQUIRED for step in hybrid_run.steps)
    for step in hybrid_run.steps:
        assert step["generated"] == step["consumed"] + step["dropped"] + step["queue_size"]


@pytest.mark.pins
def test_replicas_hold_the_trainers_version_after_each_sync(hybrid_run):
    for step in hybrid_run.steps:
        assert step["weight_version"] == step["trainer_param_version"] == step["global_step"]
        active = {rid: r for rid, r in step["replicas"].items() if r["state"] == "REPLICA_STATE_ACTIVE"}
        assert {"s0-0", "s0-1"} <= set(active), step["replicas"]
        assert {r["weight_version"] for r in active.values()} == {step["weight_version"]}
    completed = [e for e in hybrid_run.events if e["type"] == "WEIGHT_SYNC_COMPLETED"]
    assert {e["weight_version"] for e in completed} == set(range(1, STEPS + 1))


@pytest.mark.pins
def test_the_hybrid_replica_is_activated_to_help_and_released_before_training(hybrid_run):
    t = hybrid_run.summary["transitions"]
    assert t["activations"] >= STEPS // 2
    assert t["deactivations"] in (t["activations"], t["activations"] - 1)
    released = [s for s in hybrid_run.steps if s["released_replica_ids"]]
    assert released and all(s["released_replica_ids"] == ["h0"] for s in released)
    assert any(s["offload_s"] > 0 for s in hybrid_run.steps if s["hybrid_activated"])


@pytest.mark.pins
def test_summary_counts_match_a_hand_count_of_the_event_log(hybrid_run):
    events, t = hybrid_run.events, hybrid_run.summary["transitions"]
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
    to_active = [e for e in events if e["type"] == "CONTROLLER_STATE_CHANGED"
                 and e["to_state"] == "HYBRID_STATE_HYBRID_ACTIVE"]
    to_standalone = [e for e in events if e["type"] == "CONTROLLER_STATE_CHANGED"
                     and e["from_state"] == "HYBRID_STATE_HYBRID_ACTIVE"]
    assert t["activations"] == len(to_active) == sum(s["hybrid_activated"] for s in hybrid_run.steps)
    assert t["deactivations"] == len(to_standalone) == sum(bool(s["released_replica_ids"]) for s in hybrid_run.steps)
    assert t["activations"] == hybrid_run.metrics["scheduler"].get("activations", 0) or t["activations"] == int(
        hybrid_run.metrics["scheduler"]["activations"])
    skipped = [e for e in events if e["type"] == "WEIGHT_SYNC_SKIPPED"]
    assert t["skipped_hybrid_syncs"] == len(skipped) == sum(s["hybrid_sync_skipped"] for s in hybrid_run.steps)
    assert t["bytes_saved"] == sum(int(e["attributes"]["bytes_saved"]) for e in skipped) == sum(
        s["bytes_saved"] for s in hybrid_run.steps)
    assert t["weight_syncs"] == len([e for e in events if e["type"] == "WEIGHT_SYNC_COMPLETED"])


@pytest.mark.pins
def test_dynamic_resource_metrics_match_the_trainers_own_records(hybrid_run):
    cycles = hybrid_run.metrics["cycles"]
    assert len(cycles) >= STEPS - 1
    by_step = {s["global_step"]: s for s in hybrid_run.steps}
    compute_keys = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
    for cycle in cycles:
        v, step = cycle["values"], by_step[cycle["global_step"]]
        compute = sum(step["timing_raw"].get(k, 0.0) for k in compute_keys)
        assert v["dynamic_resource/train_compute_time_s"] == pytest.approx(compute, abs=1e-6)
        assert v["dynamic_resource/train_resource_utilization"] == pytest.approx(
            v["dynamic_resource/train_compute_time_s"] / v["dynamic_resource/train_allocated_time_s"], rel=1e-6)
        assert v["fully_async/rollouter/step_generated_samples"] == \
            step["rollout_metrics"]["fully_async/rollouter/step_generated_samples"]
        assert v["dynamic_resource/rollout_resource_utilization"] == pytest.approx(
            step["rollout_metrics"]["dynamic_resource/rollout_resource_utilization"], abs=1e-9)
        # Section 4.3 with a = 1 hybrid GPU, b = 2 standalone GPUs.
        a, b = 1, 2
        u_train, u_roll = v["dynamic_resource/train_resource_utilization"], \
            v["dynamic_resource/rollout_resource_utilization"]
        x = min(1.0, max(0.0, step["waited_s"] / step["timing_raw"]["step"])) if step["deactivated"] else 0.0
        expected = ((1 - x) * a * u_train + (x * a + b) * u_roll) / (a + b)
        assert v["dynamic_resource/resource_utilization"] == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.pins
def test_the_run_directory_holds_events_metrics_spans_and_the_picture(hybrid_run):
    d = hybrid_run.dir
    png = (d / "resource_time.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    from PIL import Image

    image = Image.open(d / "resource_time.png")
    rows = json.loads(image.text["rollmesh:rows"])
    assert sorted(rows) == sorted(["s0-0", "s0-1", "h0", "trainer"])
    # What the picture shows, rebuilt from the run's files: the trainer trained in every step and
    # the hybrid replica both generated and slept.
    from launcher.resource_picture import build_picture, read_events

    steps = [json.loads(line) for line in (d / "trainer" / "steps.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("event") == "step"]
    assert all({a["activity"] for a in s["activities"]} >= {"wait", "train", "weight_sync"} for s in steps[1:])
    pic = build_picture(read_events(str(d / "events.jsonl")),
                        activities=[{"row": "trainer", **a} for s in steps for a in s["activities"]])
    assert pic.time_in("trainer", "train") > 0 and pic.time_in("trainer", "weight_sync") > 0
    assert pic.time_in("h0", "rollout") > 0 and pic.time_in("h0", "sleep") > 0
    spans = [json.loads(line) for line in (d / "spans.jsonl").read_text().splitlines()]
    names = {s["name"] for s in spans}
    assert {"hybrid.deactivate", "hybrid.activate", "weights.broadcast"} <= names, names
    assert (d / "checkpoint" / "driver.pt").is_file()
    assert "stopped: " in hybrid_run.output and "(exit 0)" in hybrid_run.output
    # The trained model, in the Hugging Face format, at the last step's weight version.
    from transformers import AutoModelForCausalLM

    model_dir = d / "model"
    assert json.loads((model_dir / "rollmesh.json").read_text())["weight_version"] == steps[-1]["weight_version"]
    assert AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).config.model_type == "llama"


@pytest.mark.pins
def test_the_mesh_runs_with_mutual_tls_and_no_call_is_refused(hybrid_run):
    d = hybrid_run.dir
    assert (d / "pki" / "ca.pem").is_file()
    logs = {p.stem: p.read_text() for p in (d / "logs").glob("*.log")}
    assert len(logs) == 5   # lb, controller, trainer agent, rollout-0, trainer-0-replicas
    for name, text in logs.items():
        assert "transport mutual_tls, identity spiffe://rollmesh/" in text, name
        assert "ROLE_NOT_ALLOWED" not in text and "needs the role" not in text, name
    configs = [yaml.safe_load(p.read_text()) for p in (d / "config").glob("*.yaml")]
    assert configs and all(Path(c["tls"]["cert"]).parent == d / "pki" for c in configs)


# -- run B: the hybrid replica skips rollout; a replica agent is killed mid-run ------------------------


def test_with_a_full_enough_queue_the_hybrid_skips_rollout_and_its_sync(skip_run_with_a_kill):
    run, _ = skip_run_with_a_kill
    t = run.summary["transitions"]
    assert t["activations"] == 0 and t["deactivations"] == 0
    assert t["skipped_hybrid_syncs"] == SKIP_STEPS and t["bytes_saved"] > 0
    h0 = [e for e in run.events if e.get("replica_id") == "h0" and e["type"] == "REPLICA_STATE_CHANGED"]
    assert all(e["to_state"] == "REPLICA_STATE_SLEEPING" for e in h0), h0


def test_killing_a_replica_agent_loses_nothing_and_training_finishes(skip_run_with_a_kill):
    run, killed = skip_run_with_a_kill
    assert len(run.steps) == SKIP_STEPS and run.summary["state"] == "FINISHED"
    s = run.summary["samples"]
    assert s["samples_consumed"] == SKIP_STEPS * REQUIRED
    assert s["samples_generated"] == s["samples_consumed"] + s["samples_dropped"] + s["queue_size"]
    failed = [e for e in run.events if e.get("replica_id") == killed and e.get("to_state") == "REPLICA_STATE_FAILED"]
    assert failed, "the killed agent's replica never went FAILED"
    assert "rollout-1 exited" in run.output
    # After the kill the survivor keeps receiving every version.
    last = run.steps[-1]
    assert last["replicas"]["s0-0"]["weight_version"] == last["weight_version"] == SKIP_STEPS


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, keys", [
    ({"rollout.nnodes": 0, "async_training.use_dynamic_resource_scheduling": False},
     ["rollout.nnodes", "rollout.n_gpus_per_node", "async_training.use_dynamic_resource_scheduling"]),
    ({"async_training.max_queue_size": 7},     # one collection: 8 prompts (samples), as in verl
     ["async_training.max_queue_size", "actor_rollout_ref.actor.ppo_mini_batch_size", "async_training.require_batches"]),
    ({"trainer.nnodes": 2}, ["trainer.nnodes"]),
    ({"async_training.dynamic_schedule_policy": "nope"}, ["async_training.dynamic_schedule_policy"]),
    ({"async_training.staleness_treshold": 0.1}, ["async_training.staleness_treshold", "did you mean"]),
])
def test_a_config_that_cannot_work_is_rejected_before_anything_starts(tmp_path, capsys, changes, keys):
    config = job_config(tmp_path, "quickstart.yaml", **changes)
    run_dir = tmp_path / "run"
    assert cli_main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    for key in keys:
        assert key in err, err
    assert not run_dir.exists()


# -- Ctrl-C -------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running (its parent may not have reaped it yet)
        return f.read().split(") ")[-1].split()[0] != "Z"


def test_a_second_ctrl_c_stops_every_process_at_once(tmp_path):
    config = job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": 500})
    run_dir = tmp_path / "run"
    proc = _train(config, run_dir)
    steps_file = run_dir / "trainer" / "steps.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not (steps_file.exists() and steps_file.read_text()):
        time.sleep(0.2)
    pids = {name: p["pid"] for name, p in json.loads((run_dir / "processes.json").read_text()).items()}
    # Signal just as a step ends, so the next step is a whole step long: the first Ctrl-C alone would end the
    # run at that step's end, and that must not come before the second.
    steps = len(steps_file.read_text().splitlines())
    while time.monotonic() < deadline and proc.poll() is None and len(steps_file.read_text().splitlines()) == steps:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C delivers to the foreground process
    time.sleep(0.1)                  # the first ends the run after its step (tests/e2e/test_train_stop.py) ...
    proc.send_signal(signal.SIGINT)  # ... the second before that
    code, out = _finish(proc, timeout_s=120)
    assert code == 130, out[-3000:]
    assert "interrupted" in out and "stopped: " in out
    assert not [name for name, pid in pids.items() if _alive(pid)]


# -- the engine and the trainer must compute the same model ------------------------------------------------------


def test_a_trainer_on_other_weights_than_the_fleets_stops_the_run_naming_the_versions(tmp_path):
    """Forced: the trainer agent's model seed differs from the replicas', so step 1's on-policy samples disagree
    with the trainer's recomputation; the run stops before training on them (exit 1), saying why."""
    config = job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": 3})
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "train", "--config", str(config), "--run-dir",
                           str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, cwd=tmp_path,
                          env=clean_env(GLOO_SOCKET_IFNAME="lo", ROLLMESH_TRAINER_AGENT__MODEL_SEED="99"))
    assert proc.returncode == 1, proc.stdout[-3000:]
    error = proc.stdout.strip().splitlines()[-1]
    import torch
    import transformers

    assert error.startswith("rollmesh train: error: training failed: LogprobMismatch:"), error
    assert f"torch {torch.__version__}, transformers {transformers.__version__}" in error
    assert "(version 0)" in error and "bound 0.1, actor.logprob_mismatch_bound" in error
    assert re.search(r"differ from the trainer's by \d+\.\d+ nats per token", error)
    assert "steps                  0 / 3" in proc.stdout   # nothing trained
