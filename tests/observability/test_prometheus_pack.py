"""The shipped observability pack against the real thing: promtool, and a real Prometheus scraping the main job.

``observability/`` holds the Grafana dashboard, the recording and alert rules
(with promtool unit tests) and a scrape config. Here Debian's Prometheus runs
on loopback in a temporary directory, discovers the processes of a real
``rollmesh train`` run (``mesh.metrics: true`` writes their targets in file_sd
form), scrapes them every second with the rules loaded, and every query of
every dashboard panel is then evaluated through its HTTP API at a moment of
the run: each must return data.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.job_configs import job_config
from tests.processes import clean_env, free_port

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "observability"


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is missing (Debian package prometheus): run scripts/install as root")
    return path


def test_the_rules_and_the_scrape_config_pass_promtool(promtool):
    rules = PACK / "prometheus"
    for args in (["check", "rules", "rollmesh.rules.yml"], ["test", "rules", "rollmesh.rules.test.yml"],
                 ["check", "config", "prometheus.example.yml"]):
        result = subprocess.run([promtool, *args], cwd=rules, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (args, result.stdout + result.stderr)



def _query(base: str, expr: str, at: float) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


async def test_every_dashboard_query_returns_data_from_a_real_prometheus_scraping_the_main_job(tmp_path, promtool):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is missing (Debian package prometheus): run scripts/install as root")
    run_dir = tmp_path / "run"
    shutil.copy(PACK / "prometheus" / "rollmesh.rules.yml", tmp_path / "rollmesh.rules.yml")
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 500ms, evaluation_interval: 500ms}}
rule_files: [rollmesh.rules.yml]
scrape_configs:
  - job_name: rollmesh
    file_sd_configs: [{{files: ["{run_dir}/prometheus_targets.json"], refresh_interval: 500ms}}]
""")
    port = free_port()
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        config = job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": 40, "mesh.metrics": True})
        train = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "launcher.cli", "train", "--config", str(config), "--run-dir", str(run_dir),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(GLOO_SOCKET_IFNAME="lo"),
            cwd=ROOT)
        steps_file, last_step_at = run_dir / "trainer" / "steps.jsonl", 0.0
        deadline, steps = time.monotonic() + 240, 0
        while time.monotonic() < deadline and steps < 40:
            lines = steps_file.read_text().splitlines() if steps_file.exists() else []
            now_steps = sum(1 for line in lines if '"event": "step"' in line)
            if now_steps > steps:
                steps, last_step_at = now_steps, time.time()
            if train.returncode is not None:
                break
            await asyncio.sleep(0.1)
        out, _ = await asyncio.wait_for(train.communicate(), 240)
        assert train.returncode == 0, out.decode()[-3000:]
        at = last_step_at - 1.0   # the last step, while every process was still being scraped
        targets = json.loads((run_dir / "prometheus_targets.json").read_text())
        assert {t["labels"]["server"] for t in targets} == {"controller", "lb", "replica-agent", "trainer-agent"}
        dashboard = json.loads((PACK / "grafana" / "rollmesh-mesh.json").read_text())
        queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
        empty = [q for q in queries if not _query(base, q, at)]
        scrapes = min(int(r["value"][1]) for r in _query(base, "count_over_time(up[1m])", at))
        assert scrapes >= 3, f"each target scraped only {scrapes} time(s) before the last step"
        assert not empty, empty
        recorded = _query(base, "rollmesh:lb_requests:rate1m", at)
        assert recorded and float(recorded[0]["value"][1]) > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
