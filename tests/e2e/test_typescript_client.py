"""The generated TypeScript package (generated/ts): it type-checks under tsc --strict, and a client built on
it calls every server of a local mesh over mutual TLS, a server stream included, and decodes the
google.rpc.ErrorInfo of an error."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

import grpc

from launcher.local_mesh import start_local_mesh, stop_all
from launcher.pki import LocalPki
from tests.controller.scaling.helpers import Procs, lb_stub, routed, until
from tests.processes import clean_env

ROOT = Path(__file__).resolve().parents[2]
TSC = ROOT / "node_modules" / ".bin" / "tsc"
BUILD = ROOT / "tests" / "e2e" / "clients" / "ts" / ".build"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tsc() -> Path:
    if not TSC.exists():
        pytest.skip("node_modules/.bin/tsc is missing: run scripts/install (npm ci)")
    return TSC


def test_the_generated_package_type_checks_strictly(tsc):
    done = subprocess.run([str(tsc), "-p", "generated/ts/tsconfig.json", "--noEmit"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    config = json.loads((ROOT / "generated" / "ts" / "tsconfig.json").read_text())
    assert config["compilerOptions"]["strict"] is True


def _build(tsc: Path) -> Path:
    built = subprocess.run([str(tsc), "-p", "tests/e2e/clients/ts/tsconfig.json", "--outDir", str(BUILD)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout[-3000:]
    (BUILD / "package.json").write_text('{"type": "module"}\n')
    return BUILD / "tests" / "e2e" / "clients" / "ts" / "client.js"


def _calls(stdout: str) -> dict[str, list[dict]]:
    calls: dict[str, list[dict]] = {}
    for line in stdout.splitlines():
        entry = json.loads(line)
        calls.setdefault(entry["call"], []).append(entry)
    return calls


async def test_a_typescript_client_calls_every_server_streams_included(tsc, node, tmp_path):
    client = _build(tsc)
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        controller = procs.start("controller", "controller", f"load_balancer_address: {lb}\nstate_dir: {tmp_path}/s\n")
        agent = procs.agent("a", controller=controller, slots=1)
        trainer = procs.start("trainer", "trainer-agent", "")
        async with grpc.aio.insecure_channel(lb) as channel:
            await until(lambda: _routed(lb_stub(channel)), 60, what="the replica to be routed")
        result = await asyncio.to_thread(subprocess.run, [node, str(client), controller, lb, agent, trainer],
                                         capture_output=True, text=True, timeout=90, env=clean_env(), cwd=ROOT)
    finally:
        procs.close()
    assert result.returncode == 0, result.stdout + result.stderr
    calls = _calls(result.stdout)
    assert sorted(s["server"] for s in calls["GetStatus"]) == ["controller", "lb", "replica-agent", "trainer-agent"]
    stream = calls["WatchEvents"][0]
    assert stream["events"] >= 2 and "NODE_REGISTERED" in stream["types"]   # protobuf-es drops the enum prefix
    # one replica serves and its node has no free slot: the preview of "1 replica" is a NOOP, done at once
    assert calls["ScaleOut"][0] == {"call": "ScaleOut", "done": True, "name": "", "dryRun": True, "state": "NOOP"}
    error = calls["GetOperation"][0]["error"]
    assert error["code"] == "NotFound" and error["reason"] == "OPERATION_NOT_FOUND" and error["domain"]
    assert calls["Generate"][0] == {"call": "Generate", "tokens": 4, "error": None}
    assert calls["ListReplicas"][0]["replicas"] == ["a-s0"]


async def test_a_typescript_client_speaks_mutual_tls(tsc, node, tmp_path):
    client = _build(tsc)
    servers = await start_local_mesh(tmp_path, clean_env())
    identity = LocalPki(tmp_path / "pki").tls("client", "ts-client")
    try:
        order = ("controller", "lb", "replica-agent", "trainer-agent")
        env = {**clean_env(), "ROLLMESH_TLS_CA": identity.ca, "ROLLMESH_TLS_CERT": identity.cert,
               "ROLLMESH_TLS_KEY": identity.key}
        result = await asyncio.to_thread(subprocess.run, [node, str(client), "--status-only",
                                                          *(servers[n].address for n in order)],
                                         capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    finally:
        await stop_all(servers)
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = _calls(result.stdout)["GetStatus"]
    assert sorted(s["server"] for s in statuses) == sorted(order)
    assert {s["security"] for s in statuses} == {"MUTUAL_TLS"}


async def _routed(bal) -> bool:
    return bool(await routed(bal))
