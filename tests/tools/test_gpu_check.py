"""scripts/gpu-check itself: on CPU (--allow-cpu) every section that can run passes and the CUDA-only ones
say why they are skipped, so the script a GPU machine runs is known to work up to the device."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def test_gpu_check_runs_what_it_can_on_cpu_and_says_why_it_skips_the_rest():
    done = subprocess.run(["scripts/gpu-check", "--allow-cpu", "--preset", "tiny-llama", "--batch", "4",
                           "--tokens", "8"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    sections = {line["section"]: line for line in lines if "section" in line}
    assert lines[-1]["failed"] == []
    for name in ("environment", "torch-engine", "trainer", "megatron"):
        assert sections[name]["result"] == "OK", sections[name]
    assert sections["torch-engine"]["tokens_per_s"] > 0 and sections["torch-engine"]["bytes_freed"] > 0
    assert sections["trainer"]["weight_version"] == 1
    assert sections["nccl-broadcast"]["result"] == "SKIP" and "two GPUs" in sections["nccl-broadcast"]["why"]
    assert "CUDA" in sections["megatron"]["forward"]


def test_an_unknown_section_is_refused():
    done = subprocess.run(["scripts/gpu-check", "--only", "warp-drive"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "unknown section" in done.stderr
