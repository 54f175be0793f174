"""verl's ``CheckpointEngineManager.update_weights`` with the ``rollmesh`` backend moves the trainer's weights into
the fleet: the controller commits the version on every replica, and the replicas' greedy outputs then equal the
trainer's model's (transformers' ``generate`` in verl's environment), and the older versions' files are deleted.
A version older than the fleet's (an earlier run's fleet) fails the update before anything is sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2

from .conftest import verl_config
from .fleet import Fleet

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_cluster")]

PROMPT = [5, 72, 101, 108, 108, 111]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
          "max_tokens": 12}


@pytest.fixture(scope="module")
def setup(rollmesh_fleet: Fleet) -> Any:
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    from .trainer_worker import CpuTrainerWorker

    import ray

    config = verl_config(rollmesh_fleet)
    manager = FullyAsyncLLMServerManager.create(config=config, worker_group=None)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)   # two ranks: rank 0 sends
    trainer = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(CpuTrainerWorker), model_path=rollmesh_fleet.model,
        engine_kwargs=rollmesh_fleet.engine_kwargs()), use_gpu=False)
    checkpoints = CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine), actor_wg=trainer,
        replicas=manager.get_replicas())
    return manager, trainer, checkpoints


async def _versions(controller: str) -> dict[str, int]:
    async with grpc.aio.insecure_channel(controller) as channel:
        reply = await controller_pb2_grpc.ControllerServiceStub(channel).ListReplicas(
            registry_pb2.ListReplicasRequest(), timeout=10)
    return {r.replica_id: r.weight_version for r in reply.replicas}


def _reference(state: dict[str, torch.Tensor], model_path: str) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
    model.load_state_dict(state)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_verls_update_weights_moves_the_trainers_weights_into_every_replica(setup, rollmesh_fleet):
    from verl.workers.rollout.llm_server import LLMServerClient

    manager, trainer, checkpoints = setup
    client = manager.get_client(client_cls=LLMServerClient)
    before = asyncio.run(client.generate("before", prompt_ids=PROMPT, sampling_params=GREEDY))
    for step in (1, 2):
        trainer.train_a_step(seed=step)
        metrics = checkpoints.update_weights(global_steps=step)
        assert metrics["rollmesh/replicas_synced"] == 2 and metrics["rollmesh/replicas_failed"] == 0
        assert metrics["rollmesh/bytes_sent"] > 0
        assert asyncio.run(_versions(rollmesh_fleet.controller)) == {"n0-s0": step, "n1-s0": step}
    expected = _reference(trainer.state()[0], rollmesh_fleet.model)
    outs = [asyncio.run(client.generate(f"after{i}", prompt_ids=PROMPT, sampling_params=GREEDY)) for i in range(4)]
    assert all(o.token_ids == expected for o in outs)   # both replicas (verl's balancer alternates them)
    assert all(o.extra_fields["global_steps"] == 2 for o in outs)
    assert before.token_ids != expected


def test_a_version_older_than_the_fleets_fails_the_update_naming_both_before_sending(setup, rollmesh_fleet):
    """A verl run started afresh against a fleet that served an earlier run: versions only grow, so the update
    fails at once with what to do, and nothing is written or sent."""
    manager, trainer, checkpoints = setup
    with pytest.raises(Exception, match=r"holds weight version 2, newer than this run's 1: .*Start a fresh fleet"):
        checkpoints.update_weights(global_steps=1)
    assert set(asyncio.run(_versions(rollmesh_fleet.controller)).values()) == {2}
    assert sorted(p.name for p in Path(rollmesh_fleet.weights_dir).iterdir()) == ["2.safetensors"]
