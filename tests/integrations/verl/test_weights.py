"""verl's ``CheckpointEngineManager.update_weights`` with the ``rollmesh`` backend moves the trainer's weights into
the fleet: the controller broadcasts each version from verl's rank 0 (its own process serves the weights) and
commits it on every replica, the second as a delta, and the replicas' greedy outputs then equal the trainer's
model's (transformers' ``generate`` in verl's environment). A version older than the fleet's (an earlier run's
fleet) fails the update before anything is sent. With ``weights_dir`` the versions go through the fleet's trainer
agent instead, and the older versions' files are deleted."""

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
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager

    manager = FullyAsyncLLMServerManager.create(config=verl_config(rollmesh_fleet), worker_group=None)
    return (manager, *_trainer(rollmesh_fleet, manager))


def _trainer(rollmesh_fleet: Fleet, manager: Any, **engine_kwargs: Any) -> tuple[Any, Any]:
    """A trainer worker group of two ranks (rank 0 sends) and verl's manager of its updates."""
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    from .trainer_worker import CpuTrainerWorker

    config = verl_config(rollmesh_fleet, **engine_kwargs)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    trainer = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(CpuTrainerWorker), model_path=rollmesh_fleet.model,
        engine_kwargs=rollmesh_fleet.engine_kwargs(**engine_kwargs)), use_gpu=False)
    return trainer, CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine), actor_wg=trainer,
        replicas=manager.get_replicas())


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
    sent = []
    for step in (1, 2):
        trainer.train_a_step(seed=step, only="" if step == 1 else "model.norm.weight")
        metrics = checkpoints.update_weights(global_steps=step)
        assert metrics["rollmesh/replicas_synced"] == 2 and metrics["rollmesh/replicas_failed"] == 0
        sent.append(metrics["rollmesh/bytes_sent"])
        assert asyncio.run(_versions(rollmesh_fleet.controller)) == {"n0-s0": step, "n1-s0": step}
    assert sent[0] > 0 and sent[1] < sent[0] / 10   # step 2 moved one small tensor: a delta, not a full copy
    expected = _reference(trainer.state()[0], rollmesh_fleet.model)
    outs = [asyncio.run(client.generate(f"after{i}", prompt_ids=PROMPT, sampling_params=GREEDY)) for i in range(4)]
    assert all(o.token_ids == expected for o in outs)   # both replicas (verl's balancer alternates them)
    assert all(o.extra_fields["global_steps"] == 2 for o in outs)
    assert before.token_ids != expected


def test_a_version_older_than_the_fleets_fails_the_update_naming_both_before_sending(setup, rollmesh_fleet):
    """A verl run started afresh against a fleet that served an earlier run: versions only grow, so the update
    fails at once with what to do, and nothing is written or sent."""
    manager, trainer, checkpoints = setup
    with pytest.raises(Exception, match=r"serves weight version 2, newer than this run's 1: .*Start a fresh fleet"):
        checkpoints.update_weights(global_steps=1)
    assert set(asyncio.run(_versions(rollmesh_fleet.controller)).values()) == {2}
    _, fresh = _trainer(rollmesh_fleet, setup[0])   # a new run's rank 0: the replicas' versions say it
    with pytest.raises(Exception, match=r"replicas hold weight version 2, newer than this run's 1: .*Start a fresh"):
        fresh.update_weights(global_steps=1)
    assert set(asyncio.run(_versions(rollmesh_fleet.controller)).values()) == {2}


def test_with_weights_dir_the_versions_go_through_the_fleets_trainer_agent(setup, rollmesh_fleet):
    trainer, checkpoints = _trainer(rollmesh_fleet, setup[0], weights_dir=rollmesh_fleet.weights_dir)
    for step in (3, 4):
        trainer.train_a_step(seed=step)
        metrics = checkpoints.update_weights(global_steps=step)
        assert metrics["rollmesh/replicas_synced"] == 2 and metrics["rollmesh/bytes_sent"] > 0
    assert asyncio.run(_versions(rollmesh_fleet.controller)) == {"n0-s0": 4, "n1-s0": 4}
    assert sorted(p.name for p in Path(rollmesh_fleet.weights_dir).iterdir()) == ["4.safetensors"]
    with pytest.raises(Exception, match=r"holds weight version 4, newer than this run's 3: .*Start a fresh fleet"):
        checkpoints.update_weights(global_steps=3)
