"""examples/custom_trainer.py: a trainer process of the user's drives a real mesh with the client library
(trainer_client) and is the source of the weight broadcast through the trainer agent's DirectoryWeightSource;
a version it never published is never broadcast; the step protocol survives a controller restart mid-step."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from rollmesh.controller.v1 import registry_pb2, scaling_pb2
from tests.controller.scaling.helpers import Procs, controller_stub, replicas, until
from tests.processes import clean_env, free_port
from weight_transfer.published import publish
from trainer_client import Counters, MeshClient, StepProtocolError

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
TRAINER = """model: tiny-llama
weight_source: trainer_agent.published_weights:DirectoryWeightSource
weight_source_options: {{directory: {weights}}}
"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
state_dir: {state}
lease_ttl_s: 5
load_report_interval_s: 0.3
"""
AGENT = """node_id: a
backend: torch
model: tiny-llama
controller_address: {controller}
engine_options: {{max_batch_size: 32}}
replicas:
  - {{replica_id: a-s0, kind: STANDALONE}}
"""


def _mesh(tmp_path: Path, procs: Procs, controller_listen: str = "127.0.0.1:0") -> tuple[str, str, str]:
    weights = tmp_path / "weights"
    lb = procs.start("lb", "lb", "")
    trainer = procs.start("trainer", "trainer-agent", TRAINER.format(weights=weights))
    controller = procs.start("controller", "controller", CONTROLLER.format(lb=lb, trainer=trainer,
                                                                          state=tmp_path / "state"),
                             listen=controller_listen)
    procs.start("a", "replica-agent", AGENT.format(controller=controller))
    return lb, controller, str(weights)


async def _versions(controller: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(controller) as channel:
        return {r: rec.weight_version for r, rec in (await replicas(controller_stub(channel))).items()}


async def test_the_custom_trainer_example_trains_and_broadcasts_its_own_weights(tmp_path):
    procs = Procs(tmp_path)
    try:
        lb, controller, weights = _mesh(tmp_path, procs)
        await until(lambda: _has(controller, "a-s0"), 60, what="the replica to register")
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "examples/custom_trainer.py",
                                                        "--controller", controller, "--lb", lb,
                                                        "--weights-dir", weights, "--steps", "3"],
                                       capture_output=True, text=True, timeout=240, cwd=ROOT, env=clean_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        steps = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [s["weight_version"] for s in steps] == [1, 2, 3] and all(s["bytes_sent"] > 0 for s in steps)
        assert (await _versions(controller))["a-s0"] == 3
        assert sorted(p.name for p in Path(weights).glob("*.safetensors")) == ["1.safetensors", "2.safetensors",
                                                                             "3.safetensors"]

        # A version the trainer never published is never attached to other weights: the sync fails.
        async with MeshClient(controller, retry_deadline_s=20) as mesh:
            counters = Counters(required_samples=4, generated_samples=16)
            await mesh.begin_step(4, counters)
            try:
                done = await mesh.complete_step(4, 99, counters)
            except StepProtocolError as err:
                assert "99" in str(err), err
            else:
                assert "99" in done.failed_replicas.get("a-s0", ""), done.response
        assert (await _versions(controller))["a-s0"] == 3
    finally:
        procs.close()


async def test_a_step_survives_a_controller_restart_between_begin_and_complete(tmp_path):
    port = free_port()
    procs = Procs(tmp_path)
    try:
        lb, controller, weights = _mesh(tmp_path, procs, controller_listen=f"127.0.0.1:{port}")
        await until(lambda: _has(controller, "a-s0"), 60, what="the replica to register")
        base = {n: t for n, t in _tiny_weights().items()}
        async with MeshClient(controller, retry_deadline_s=90) as mesh:
            counters = Counters(required_samples=4, generated_samples=4)
            await mesh.begin_step(1, counters)
            publish(weights, {n: t + 0.01 for n, t in base.items()}, 1)
            procs.kill("controller")   # mid-step: the step's begin is on disk, its complete not sent yet
            config = CONTROLLER.format(lb=lb, trainer=procs_address(procs, "trainer"), state=tmp_path / "state")
            restart = asyncio.get_running_loop().run_in_executor(
                None, lambda: procs.start("controller", "controller", config, listen=f"127.0.0.1:{port}"))
            done = await mesh.complete_step(1, 1, counters)   # retried until the new controller answers
            await restart
            assert done.bytes_sent > 0
        await until(lambda: _version_is(controller, "a-s0", 1), 60, what="the replica to hold version 1")
    finally:
        procs.close()


def procs_address(procs: Procs, name: str) -> str:
    return procs.addresses[name]


def _tiny_weights() -> dict[str, torch.Tensor]:
    from trainer_agent.weight_source import TorchWeightSource

    source = TorchWeightSource("tiny-llama")
    source.load()
    return {n: t.clone() for n, t in source.named_weights()}


async def _has(controller: str, replica_id: str) -> bool:
    async with grpc.aio.insecure_channel(controller) as channel:
        reply = await controller_stub(channel).ListReplicas(registry_pb2.ListReplicasRequest(), timeout=5)
    return any(r.replica_id == replica_id for r in reply.replicas)


async def _version_is(controller: str, replica_id: str, version: int) -> bool:
    return (await _versions(controller)).get(replica_id) == version


async def test_events_resume_after_a_controller_restart_and_scale_operations_wait(tmp_path):
    port = free_port()
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        config = f"load_balancer_address: {lb}\nstate_dir: {tmp_path / 'state'}\nlease_ttl_s: 5\n"
        controller = procs.start("controller", "controller", config, listen=f"127.0.0.1:{port}")
        procs.agent("a", controller=controller, slots=1)
        extra = procs.agent("e", slots=1)
        async with MeshClient(controller, retry_deadline_s=90) as mesh:
            events = mesh.events(include_history=True)
            seen = [await anext(events)]
            while seen[-1].sequence < (await mesh.status()).last_event_sequence:
                seen.append(await anext(events))
            procs.kill("controller")
            restart = asyncio.get_running_loop().run_in_executor(
                None, lambda: procs.start("controller", "controller", config, listen=f"127.0.0.1:{port}"))
            await restart
            operation = await mesh.scale_out(engine_addresses=[extra], wait=True, timeout_s=120)
            assert operation.state == scaling_pb2.OPERATION_STATE_ACTIVE, operation
            after = []
            while not any(e.operation_id == operation.operation_id and e.to_state == "OPERATION_STATE_ACTIVE"
                          for e in after):
                after.append(await asyncio.wait_for(anext(events), 30))
            sequences = [e.sequence for e in seen + after]
            assert sequences == sorted(set(sequences)), "an event was seen twice or out of order"
            await events.aclose()
            gone = await mesh.scale_in(engine_addresses=[extra], wait=True, timeout_s=120)
            assert gone.state == scaling_pb2.OPERATION_STATE_COMPLETED
    finally:
        procs.close()
