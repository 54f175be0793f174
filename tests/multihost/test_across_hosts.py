"""A training job across five hosts (network namespaces on one bridge), partitioned while it trains.

Runs as root with iproute2 (CI here does); skips, saying why, where the kernel
or the user may not create network namespaces.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.job_config import JobConfig
from mesh_runtime.config import resolve_paths

from tests.multihost import netns
from tests.processes import clean_env

ROOT = Path(__file__).resolve().parents[2]
WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.timeout(900), pytest.mark.skipif(bool(WHY_NOT), reason=f"no network namespaces: {WHY_NOT}")]

HOSTS = ["controller", "lb", "node0", "node1", "trainer", "operator"]
PLACEMENT = {"controller": "controller", "lb": "lb", "rollout-0": "node0", "rollout-1": "node1",
             "trainer-agent": "trainer", "trainer-0-replicas": "trainer"}
ACTIVE = 4   # rollmesh.common.v1.REPLICA_STATE_ACTIVE
CEILING = 5000   # total_training_steps; the job ends training (StopTraining) once the partitions are done


def _job_config(path: Path, steps: int) -> Path:
    examples = ROOT / "examples"   # its paths are relative to it: the copy keeps them pointing there
    config = resolve_paths(JobConfig, yaml.safe_load((examples / "quickstart.yaml").read_text()), examples)
    config["rollout"] = {"nnodes": 2, "n_gpus_per_node": 1}          # two inference nodes, one replica each
    config["trainer"]["total_training_steps"] = steps
    config["mesh"] = {**config["mesh"], "lease_ttl_s": 4, "gloo_interface": "eth0"}
    path.write_text(yaml.safe_dump(config))
    return path


def _run(tmp_path: Path, *, steps: int, faults: bool) -> dict:
    network = netns.Network(HOSTS)
    try:
        spec = {"network": network.describe(), "run_dir": str(tmp_path / "run"), "placement": PLACEMENT,
                "job_config": str(_job_config(tmp_path / "job.yaml", steps)), "faults": faults,
                "env": clean_env(OMP_NUM_THREADS="1")}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run([*network.prefix("operator"), sys.executable, "-m", "tests.multihost.job",
                               str(tmp_path / "spec.json")], cwd=ROOT, env=clean_env(), capture_output=True,
                              text=True, timeout=800)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in (tmp_path / "run" / "logs").glob("*.log"))
        assert done.returncode == 0, (done.stdout[-3000:] + done.stderr[-3000:] + logs)
        return json.loads((tmp_path / "run" / "multihost.json").read_text())
    finally:
        network.close()


def test_a_training_job_survives_partitions_between_hosts(tmp_path):
    record = _run(tmp_path, steps=CEILING, faults=True)
    assert "error" not in record and "stop_error" not in record, record
    assert 0 < record["stopped_after_step"] == record["progress"]["global_step"] < CEILING
    # every replica serves from its own host, at the address it advertised
    replicas = record["replicas"]
    for replica in replicas.values():
        assert replica["address"].startswith(netns.SUBNET + "."), replica
    by_node = {r["node"] for r in replicas.values()}
    assert {"rollout-0", "rollout-1", "trainer-0"} <= by_node
    cut_lb, cut_controller, slow = record["phases"]
    # 1. balancer | node 0: its requests went on elsewhere, none failed, node 0 came back
    assert cut_lb["retries"] > 0 and cut_lb["failed"] == 0, cut_lb
    # 2. controller | node 1: its lease expired and its replicas left routing; they came back current
    assert cut_controller["out_of_routing_after_s"] > 0
    assert min(cut_controller["node_versions"]) >= max(cut_controller["other_versions"]) - 1, cut_controller
    # 3. trainer -> node 0 slow and lossy: syncs go on (slower) or fail cleanly; the node's version only moves
    # forward, and it is current again once the link is
    assert slow["syncs_completed"] > 0, slow
    assert slow["versions_seen"] == sorted(slow["versions_seen"]), slow
    # every port of the trainer's connections (gRPC, the rendezvous store, gloo's pairs) is a fixed service
    # port or one of the namespace's ephemeral range: the range a firewall opens for weight broadcasts
    low, high = netns.EPHEMERAL_PORTS
    assert slow["trainer_ports"] and all(low <= p <= high or p in (50053, 50054) for p in slow["trainer_ports"]), slow
    assert all(r["state"] == ACTIVE for r in replicas.values() if r["node"].startswith("rollout-"))
    # nothing lost: no request failed (the trainer cancels what it no longer needs when training ends)
    lb = record["lb"]
    assert lb["failed"] == 0 and lb["completed"] + lb["cancelled"] == lb["requests"], lb


PROBE = """
import grpc, sys
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2
from mesh_runtime.errors import error_info
stub = controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(sys.argv[1]))
try:
    stub.RegisterNode(registry_pb2.RegisterNodeRequest(node_id="n0", address=sys.argv[2], slots_total=1), timeout=20)
    print("accepted")
except grpc.RpcError as err:
    print(err.code().name, error_info(err).reason, err.details())
"""


def test_a_node_advertising_loopback_from_another_host_is_refused(tmp_path):
    from tests.processes import running_server

    network = netns.Network(["controller", "node0"])
    try:
        ctl = network.addresses["controller"]
        env = clean_env()
        with running_server("controller", ["--listen", f"{ctl}:50051", "--insecure"], log_path=tmp_path / "c.log",
                            env=env, prefix=network.prefix("controller")) as (address, _):
            def register(advertised: str) -> str:
                done = subprocess.run([*network.prefix("node0"), sys.executable, "-c", PROBE, address, advertised],
                                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr[-2000:]
                return done.stdout.strip()

            refused = register("127.0.0.1:50053")
            assert refused.startswith("INVALID_ARGUMENT LOOPBACK_ADVERTISED"), refused
            assert f"calls from {network.addresses['node0']}" in refused and "advertise_address" in refused
            assert register("0.0.0.0:50053").startswith("INVALID_ARGUMENT UNREACHABLE_ADDRESS")
            assert register(f"{network.addresses['node0']}:50053") == "accepted"
    finally:
        network.close()
