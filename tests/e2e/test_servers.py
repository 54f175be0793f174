"""Every server as its own process: readiness line, health, reflection, status, shutdown."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.processes import server_command, start_server
from launcher.local_mesh import STATUS_SERVICES, local_client_tls, start_local_mesh, stop_all
from tests.processes import clean_env

pytestmark = [pytest.mark.timeout(120)]

SERVICE_OF = {
    "controller": "rollmesh.controller.v1.ControllerService",
    "lb": "rollmesh.loadbalancer.v1.LoadBalancerService",
    "replica-agent": "rollmesh.replica.v1.ReplicaAgentService",
    "trainer-agent": "rollmesh.trainer.v1.TrainerAgentService",
}


def buf_curl(buf, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(buf), "curl", "--protocol", "grpc", "--http2-prior-knowledge", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", list(SERVICE_OF))
async def test_server_process_explorable_by_reflection_and_stops_cleanly(name, buf, tmp_path):
    grace = 3.0
    proc = await start_server(name, ["--listen", "127.0.0.1:0"],
                              env={**_env(), f"ROLLMESH_{name.upper().replace('-', '_')}__SHUTDOWN_GRACE_S": str(grace)},
                              log_path=tmp_path / "server.log")
    try:
        # Exactly one readiness line, naming the real port.
        assert proc.stdout_lines == [f"rollmesh {name} listening on {proc.address}"]
        assert not proc.address.endswith(":0")
        async with grpc.aio.insecure_channel(proc.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_OF[name]):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

        listed = await asyncio.to_thread(buf_curl, buf, "--list-services", f"http://{proc.address}")
        assert listed.returncode == 0, listed.stderr
        services = set(listed.stdout.split())
        assert {SERVICE_OF[name], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services

        url = f"http://{proc.address}/{SERVICE_OF[name]}/GetStatus"
        called = await asyncio.to_thread(buf_curl, buf, url, "-d", "{}")
        assert called.returncode == 0, called.stderr
        status = json.loads(called.stdout)["status"]
        assert status["serverName"] == name
        assert status["ready"] is True
        assert status["listenAddress"] == proc.address
        assert "status" in status["capabilities"]
        assert status["config"]["shutdown_grace_s"] == grace
    finally:
        started = time.monotonic()
        code = await proc.terminate(grace_s=grace + 10)
        elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed < grace + 5


def _env() -> dict[str, str]:
    return clean_env()


def _run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(server_command(args[0], args[1:]), capture_output=True, text=True,
                          timeout=timeout, env=_env())


@pytest.mark.parametrize("yaml_text, key", [
    ("listen: 127.0.0.1:0\nshutdown_grace: 3\n", "shutdown_grace"),
    ("shutdown_grace_s: -1\n", "shutdown_grace_s"),
    ("listen: [1, 2]\n", "listen"),
])
def test_bad_config_exits_2_with_one_line_naming_the_key(tmp_path, yaml_text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    result = _run_cli("lb", "--config", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"'{key}'" in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("args, fragment", [
    (("controller", "--listen", "localhost"), "listen"),
    (("replica-agent", "--listen", "127.0.0.1:99999"), "listen"),
    (("trainer-agent", "--no-such-flag"), "--no-such-flag"),
    (("lb", "--config", "/nonexistent/lb.yaml"), "/nonexistent/lb.yaml"),
])
def test_bad_flag_exits_2_with_one_line(args, fragment):
    result = _run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0]


def test_print_default_config_lists_documented_keys():
    result = _run_cli("lb", "--print-default-config")
    assert result.returncode == 0
    assert "listen: 127.0.0.1:50052" in result.stdout or "listen: '127.0.0.1:50052'" in result.stdout
    assert "# seconds in-flight RPCs may take" in result.stdout


async def test_node_client_calls_status_of_every_server(node, tmp_path):
    servers = await start_local_mesh(tmp_path, _env())   # mutual TLS, as rollmesh up runs it
    tls = local_client_tls(tmp_path)
    try:
        targets = [f"{SERVICE_OF[name]}={proc.address}" for name, proc in servers.items()]
        env = {**_env(), "ROLLMESH_TLS_CA": tls.ca, "ROLLMESH_TLS_CERT": tls.cert, "ROLLMESH_TLS_KEY": tls.key}
        result = await asyncio.to_thread(subprocess.run, [node, "tests/e2e/clients/status_client.js", *targets],
                                         capture_output=True, text=True, timeout=60, env=env)
    finally:
        codes = await stop_all(servers)
    assert result.returncode == 0, result.stdout + result.stderr
    replies = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["service"] for r in replies} == set(STATUS_SERVICES)
    by_service = {r["service"]: r["status"] for r in replies}
    for name, service in SERVICE_OF.items():
        assert by_service[service]["serverName"] == name
        assert by_service[service]["ready"] is True
        assert by_service[service]["transportSecurity"] == "TRANSPORT_SECURITY_MUTUAL_TLS"
    assert set(codes.values()) == {0}


def test_rollmesh_up_prints_every_server_and_stops(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--run-dir", str(tmp_path),
                             "--exit-after-status"], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stdout + result.stderr
    for name in SERVICE_OF:
        assert any(line.startswith(name + " ") and " true " in line for line in result.stdout.splitlines())
    assert "stopped: " in result.stdout
