"""``rollmesh train`` sends its spans to the user's OTLP collector as well as to the run directory."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.e2e.job_configs import job_config
from tests.otlp_receiver import start_receiver
from tests.processes import clean_env

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
ERROR = 2   # Status.STATUS_CODE_ERROR in OTLP


async def test_the_users_collector_receives_every_servers_spans_and_so_does_the_run_directory(tmp_path):
    server, receiver, port = await start_receiver()
    config = job_config(tmp_path, "quickstart.yaml", **{"trainer.total_training_steps": 3})
    env = clean_env(GLOO_SOCKET_IFNAME="lo", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200",
                    ROLLMESH_LOG_FORMAT="json")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "launcher.cli", "train", "--config", str(config), "--run-dir",
            str(tmp_path / "run"), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT)
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, out.decode()[-3000:]
        services = {"rollmesh-controller", "rollmesh-lb", "rollmesh-replica-agent", "rollmesh-trainer-agent"}
        await receiver.wait_for(lambda spans: services <= {s.service for s in spans}, 30)
        in_run = [json.loads(line) for line in (tmp_path / "run" / "spans.jsonl").read_text().splitlines()]
        assert in_run and {s["name"] for s in in_run} >= {"weights.broadcast"}
        users = {s.trace_id for s in receiver.spans}
        assert users & {s["trace_id"] for s in in_run}   # the same traces in both places
        # a healthy run: its planned interruptions (aborts at weight syncs, refusals by a waking hybrid)
        # are span events, and no span reports an error
        errors = [(s["service"], s["name"], s["status_message"]) for s in in_run if s["status_code"] == ERROR]
        assert not errors, errors[:5]
        # attribute names: the semantic conventions' namespaces, or rollmesh's own
        keys = {k for s in in_run for k in [*s["attributes"], *(k for e in s["events"] for k in e["attributes"])]}
        assert {k for k in keys if not k.startswith(("rpc.", "network.", "server.", "error.", "rollmesh."))} == set()
        # JSON logs: each transition is a line, and a line emitted inside a span names a trace of the run
        logs = {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
                for path in (tmp_path / "run" / "logs").glob("*.log")}
        transitions = [line for line in logs["controller"] if line.get("event_type") == "REPLICA_STATE_CHANGED"]
        assert {"SLEEPING -> SYNCING", "PAUSED -> ACTIVE", "DRAINING -> SLEEPING"} <= {
            line["message"].split(" ", 3)[3].split(":")[0] for line in transitions}
        traced = [line for lines in logs.values() for line in lines if "trace_id" in line]
        assert traced and {line["trace_id"] for line in traced} & {s["trace_id"] for s in in_run}
        planned = [e["name"] for s in in_run for e in s["events"]]
        print("planned interruptions:", {name: planned.count(name) for name in set(planned)})
    finally:
        await server.stop(0)
