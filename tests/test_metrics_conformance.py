"""Every server's /metrics passes ``promtool check metrics`` (the Prometheus naming and format rules).

Runs the four servers as processes with a metrics listener, makes some traffic
(a registration, a generation through the balancer, the step protocol), then
scrapes each and hands the exposition to Debian's promtool. ``HEAD /metrics``
answers 200 with no body; other paths are 404.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import pytest

from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as lb_pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc
from rollmesh.trainer.v1 import trainer_agent_pb2, trainer_agent_pb2_grpc
from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(180)

AGENT = """node_id: m0
slots: 1
backend: synthetic
controller_address: {controller}
metrics_listen: 127.0.0.1:0
replicas: [{{replica_id: m0-0}}]
"""


def _metrics_url(log_path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = re.search(r"Prometheus metrics on (\S+)", log_path.read_text())
        if match:
            return match.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no metrics address in {log_path}")


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is missing (Debian package prometheus): run scripts/install as root")
    return path


async def test_every_servers_metrics_pass_promtool(tmp_path, promtool):
    env = clean_env()
    metrics = ["--config", str(tmp_path / "m.yaml")]
    (tmp_path / "m.yaml").write_text("metrics_listen: 127.0.0.1:0\n")
    with running_server("lb", [*metrics, "--listen", "127.0.0.1:0"], env=env, log_path=tmp_path / "lb.log") as (lb, _), \
         running_server("trainer-agent", [*metrics, "--listen", "127.0.0.1:0"], env=env,
                        log_path=tmp_path / "trainer.log") as (trainer, _):
        (tmp_path / "c.yaml").write_text(f"metrics_listen: 127.0.0.1:0\nload_balancer_address: {lb}\n"
                                         "reconcile_interval_s: 0.2\n")
        with running_server("controller", ["--config", str(tmp_path / "c.yaml"), "--listen", "127.0.0.1:0"],
                            env=env, log_path=tmp_path / "c.log") as (controller, _):
            (tmp_path / "a.yaml").write_text(AGENT.format(controller=controller))
            with running_server("replica-agent", ["--config", str(tmp_path / "a.yaml"), "--listen", "127.0.0.1:0"],
                                env=env, log_path=tmp_path / "a.log"):
                async with grpc.aio.insecure_channel(lb) as channel:
                    stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
                    deadline = time.monotonic() + 30
                    while not (await stub.ListReplicas(lb_pb.ListReplicasRequest())).replicas:
                        assert time.monotonic() < deadline
                        time.sleep(0.1)
                    req = lb_pb.GenerateRequest(request_id="m1", prompt_token_ids=[1, 2],
                                                sampling_params=generation_pb2.SamplingParams(max_tokens=8))
                    async for _ in stub.Generate(req, timeout=30):
                        pass
                async with grpc.aio.insecure_channel(trainer) as channel:
                    await trainer_agent_pb2_grpc.TrainerAgentServiceStub(channel).GetTrainingProgress(
                        trainer_agent_pb2.GetTrainingProgressRequest(), timeout=10)
                bodies = {}
                for name in ("lb", "trainer", "c", "a"):
                    url = _metrics_url(tmp_path / f"{name}.log")
                    bodies[name] = urllib.request.urlopen(url, timeout=10).read()
                    head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10)
                    assert head.status == 200 and head.read() == b""
                    with pytest.raises(urllib.error.HTTPError) as info:
                        urllib.request.urlopen(url.replace("/metrics", "/nope"), timeout=10)
                    assert info.value.code == 404
    for name, body in bodies.items():
        checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
        assert checked.returncode == 0, (name, checked.stdout.decode() + checked.stderr.decode())
        text = body.decode()
        assert "grpc_server_handled_total{" in text and "process_cpu_seconds_total" in text, name
    lb_text = bodies["lb"].decode()
    assert "rollmesh_lb_requests_total 1.0" in lb_text and "_total_total" not in lb_text
    assert 'rollmesh_lb_request_duration_seconds_count{outcome="completed"} 1.0' in lb_text
    assert "rollmesh_replica_generated_tokens_total" in bodies["a"].decode()
    assert 'rollmesh_controller_replicas{kind="STANDALONE",state="ACTIVE"} 1.0' in bodies["c"].decode()
    assert "rollmesh_trainer_global_step" in bodies["trainer"].decode()
    assert "rollmesh_lb_sticky_sessions 0.0" in lb_text
    assert "rollmesh_controller_event_history_events" in bodies["c"].decode()
    assert 'rollmesh_controller_balancers{ready="true"} 1.0' in bodies["c"].decode()   # its configured balancer
