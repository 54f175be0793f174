"""``rollmesh train`` on a verl user's dataset and reward function: a parquet file as verl's preprocessing
writes it and a compute_score file with verl's signature train unchanged across the real processes; a dict
reward's extras are logged per step; a broken reward fails the run naming the row; a missing dataset or a
bad key exits 2 naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.e2e.job_configs import job_config
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(420)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": 1.0 if solution_str.strip() == ground_truth else 0.1 * min(digits, 3),
            "digits": float(digits)}

def broken(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 / (extra_info["index"] - 2)
'''


def _files(tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"data_source": "toy/next", "ability": "math",
             "prompt": [{"role": "user", "content": f"after {i}:"}],
             "reward_model": {"style": "rule", "ground_truth": str((i + 1) % 10)},
             "extra_info": {"split": "train", "index": i}} for i in range(8)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return data, reward


def _train(tmp_path: Path, config: Path, timeout: float = 360) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "train", "--config", str(config),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    return proc, run_dir


def _config(tmp_path: Path, **changes) -> Path:
    data, reward = _files(tmp_path)
    return job_config(tmp_path, "quickstart.yaml", **{
        "trainer.total_training_steps": STEPS, "data.train_files": [str(data)], "data.max_response_length": 4,
        "custom_reward_function.path": str(reward), **changes})


def test_a_verl_dataset_and_reward_function_train_unchanged(tmp_path):
    proc, run_dir = _train(tmp_path, _config(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["event"] == "step"]
    assert len(steps) == STEPS
    assert all("reward_extra/digits" in s["metrics"] and s["metrics"]["response_length/mean"] <= 4 for s in steps)
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)


def test_a_broken_reward_fails_the_run_naming_the_row(tmp_path):
    proc, run_dir = _train(tmp_path, _config(tmp_path, **{"custom_reward_function.name": "broken"}))
    out = proc.stdout + proc.stderr + "".join(p.read_text() for p in run_dir.glob("**/*.log"))
    assert proc.returncode != 0
    assert "failed on row 2" in out and "ZeroDivisionError" in out


@pytest.mark.parametrize("changes, fragment", [
    ({"data.train_files": ["/nonexistent/train.parquet"]}, "data.train_files"),
    ({"data.prompt_key": "question"}, "no column 'question'"),
    ({"custom_reward_function.name": "missing_fn"}, "custom_reward_function.name"),
])
def test_a_bad_dataset_or_reward_exits_2_naming_it(tmp_path, changes, fragment):
    proc, _ = _train(tmp_path, _config(tmp_path, **changes), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr
