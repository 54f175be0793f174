"""A real rollmesh fleet for the verl plugin's tests, run from rollmesh's own environment (``.venv``) while the
tests run in verl's (``.venv-verl``: verl 0.9 pins transformers < 5.11, rollmesh's engines need >= 5.20), as a
verl user runs them: separate processes, one environment each.

The fleet: a load balancer; a trainer agent whose weights are the versions published into ``weights_dir``
(``DirectoryWeightSource``: the plugin's file hand-off; by default verl's rank 0 serves its own weights and names
itself in each sync); a controller; and ``agents`` replica agents with one torch replica each, all serving
one Hugging Face directory (tiny-llama, seed 0, written by rollmesh's environment).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.processes import clean_env, running_server

ROOT = Path(__file__).resolve().parents[3]
ROLLMESH_PYTHON = str(ROOT / ".venv" / "bin" / "python")

# the fleet stops fast: a test's clients may hold streams open (their Ray actors outlive a test)
STOP_FAST = "shutdown_grace_s: 1\n"
TRAINER = """model: {model}
weight_source: trainer_agent.published_weights:DirectoryWeightSource
weight_source_options: {{directory: {weights}}}
"""
PREFIX = {"lb": "ROLLMESH_LB", "controller": "ROLLMESH_CONTROLLER", "replica-agent": "ROLLMESH_REPLICA_AGENT",
          "trainer-agent": "ROLLMESH_TRAINER_AGENT"}
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 5
load_report_interval_s: 0.3
"""
AGENT = """node_id: {node}
backend: torch
model: {model}
controller_address: {controller}
stream_interval: 4
weight_transfer: {{gloo_interface: lo}}
engine_options: {{max_batch_size: 32}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
"""


@dataclasses.dataclass
class Fleet:
    controller: str
    lb: str
    model: str
    weights_dir: str
    agents: dict[str, subprocess.Popen]

    def kill_agent(self, node: str) -> None:
        """SIGKILL the replica agent of ``node`` (no goodbye: its replica dies mid-generation)."""
        os.killpg(self.agents[node].pid, signal.SIGKILL)

    def engine_kwargs(self, **more: object) -> dict[str, object]:
        """The ``engine_kwargs.rollmesh`` block of verl's config for this fleet: rank 0 serves its weights from
        its own process (``weights_dir=fleet.weights_dir`` among ``more``: through the trainer agent instead)."""
        return {"controller": self.controller, **more}


def write_model(directory: Path, seed: int = 0, preset: str = "tiny-llama") -> str:
    """A rollmesh preset with ``seed`` as a Hugging Face directory, written by rollmesh's environment."""
    subprocess.run([ROLLMESH_PYTHON, "-c", "import sys; from modeling.presets import save_preset; "
                    "save_preset(sys.argv[3], int(sys.argv[2]), sys.argv[1])", str(directory), str(seed), preset],
                   check=True, cwd=ROOT, env=clean_env(), timeout=120)
    return str(directory)


@contextlib.contextmanager
def fleet(tmp_path: Path, *, agents: int = 2, model: str | None = None, trainer: str = TRAINER,
          pki: Any = None) -> Iterator[Fleet]:
    """``trainer``: the trainer agent's config (a format string of ``model`` and ``weights``); the default serves
    the versions published into ``weights_dir``. ``pki`` (a :class:`launcher.pki.LocalPki`): a secure mesh, every
    server with a certificate of its CA (mutual TLS, roles, signed weight manifests)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = model or write_model(tmp_path / "model")
    weights = tmp_path / "weights"
    env = clean_env(GLOO_SOCKET_IFNAME="lo")

    def start(name: str, server: str, config: str) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen]]:
        (tmp_path / f"{name}.yaml").write_text(config)
        identity = pki.env(PREFIX[server], server, name) if pki is not None else {}
        return running_server(server, ["--config", str(tmp_path / f"{name}.yaml"), "--listen", "127.0.0.1:0"],
                              log_path=tmp_path / f"{name}.log", env={**env, **identity}, python=ROLLMESH_PYTHON)

    with contextlib.ExitStack() as stack:
        lb, _ = stack.enter_context(start("lb", "lb", STOP_FAST))
        agent, _ = stack.enter_context(start("trainer", "trainer-agent", STOP_FAST + trainer.format(
            model=model, weights=weights)))
        controller, _ = stack.enter_context(start("controller", "controller", STOP_FAST + CONTROLLER.format(
            lb=lb, trainer=agent)))
        procs = {}
        for i in range(agents):
            node = f"n{i}"
            _, procs[node] = stack.enter_context(start(node, "replica-agent", STOP_FAST + AGENT.format(
                node=node, model=model, controller=controller)))
        _wait_serving(controller, [f"{node}-s0" for node in procs],
                      pki.tls("operator", "tests") if pki is not None else None)
        yield Fleet(controller, lb, model, str(weights), procs)


def _wait_serving(controller: str, replica_ids: list[str], tls: Any = None, timeout_s: float = 90.0) -> None:
    """Until the controller lists every replica ACTIVE (registered, routed)."""
    from mesh_runtime.channels import open_sync_channel
    from rollmesh.common.v1 import types_pb2
    from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

    deadline = time.monotonic() + timeout_s
    with open_sync_channel(controller, tls=tls) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        while True:
            listed = stub.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=5).replicas
            active = {r.replica_id for r in listed if r.state == types_pb2.REPLICA_STATE_ACTIVE}
            if set(replica_ids) <= active:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas not ACTIVE within {timeout_s} s: {sorted(active)}")
            time.sleep(0.1)
