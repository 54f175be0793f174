"""Faults under verl's client, and bad configuration refused before verl trains: a replica agent SIGKILLed
mid-rollout costs verl no request; an unreachable controller, a model that differs from the fleet's, a verl
outside the tested range and a malformed rollmesh block each get a clear error at start."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from .conftest import verl_config
from .fleet import Fleet, fleet, write_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_cluster")]

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _manager(config: Any) -> Any:
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager

    return FullyAsyncLLMServerManager.create(config=config, worker_group=None)


async def test_a_replica_agent_killed_mid_rollout_costs_verl_no_request(tmp_path):
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    with fleet(tmp_path) as f:
        manager = await FullyAsyncLLMServerManager.create(config=verl_config(f), worker_group=None)
        client = manager.get_client(client_cls=FullyAsyncLLMServerClient)
        tasks = [asyncio.create_task(client.generate(f"k{i}", prompt_ids=[5, 6, 7 + i],
                                                     sampling_params={**SAMPLING, "max_tokens": 200}))
                 for i in range(16)]
        deadline = time.monotonic() + 60
        while not any(s["streamed"] for s in await asyncio.gather(*(r.server_handle.status.remote()
                                                                     for r in manager.get_replicas()))):
            assert time.monotonic() < deadline, "no generation streamed tokens"
            await asyncio.sleep(0.02)
        f.kill_agent("n0")   # its replica dies without a goodbye, mid-generation
        outputs = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        stats = await _balancer_stats(f.lb)
    assert all(len(o.token_ids) == len(o.log_probs) == 200 for o in outputs)
    assert all(o.stop_reason == "length" for o in outputs)
    assert stats.retries > 0 and stats.failed == 0   # the dead replica's generations went on elsewhere


async def _balancer_stats(address: str) -> Any:
    import grpc

    from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        reply = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel).GetStats(
            loadbalancer_pb2.GetStatsRequest(), timeout=10)
    return reply.stats


def test_an_unreachable_controller_is_refused_naming_it(rollmesh_fleet: Fleet):
    from rollmesh_verl.checks import FleetCheckFailed

    bad = Fleet("127.0.0.1:1", rollmesh_fleet.lb, rollmesh_fleet.model, rollmesh_fleet.weights_dir, {})
    with pytest.raises(FleetCheckFailed, match=r"controller at 127\.0\.0\.1:1 did not answer"):
        _manager(verl_config(bad, call_timeout_s=3))


def test_a_model_other_than_the_fleets_is_refused(rollmesh_fleet: Fleet, tmp_path):
    from rollmesh_verl.checks import FleetCheckFailed

    other = write_model(tmp_path / "qwen", preset="tiny-qwen2")
    with pytest.raises(FleetCheckFailed, match="node n0 of the rollmesh fleet serves .* not verl's model .*"
                                               "model_type 'llama' vs verl's 'qwen2'"):
        _manager(verl_config(rollmesh_fleet, model=other))


def test_a_model_with_another_tokenizer_is_refused(rollmesh_fleet: Fleet, tmp_path):
    """The same architecture, another vocabulary (a token renamed): refused too."""
    import json
    import shutil

    from rollmesh_verl.checks import FleetCheckFailed

    changed = tmp_path / "renamed"
    shutil.copytree(rollmesh_fleet.model, changed)
    tokenizer = json.loads((changed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["#renamed#"] = vocab.pop(next(k for k in vocab if k == "A"))
    (changed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(FleetCheckFailed, match="the tokenizers' vocabularies differ"):
        _manager(verl_config(rollmesh_fleet, model=str(changed)))


def test_a_verl_outside_the_tested_range_is_refused():
    from rollmesh_verl.checks import FleetCheckFailed, check_verl_version

    check_verl_version("0.9.1")
    for version in ("0.8.0", "0.10.0", "1.0.0"):
        with pytest.raises(FleetCheckFailed, match=f"verl {version} is outside the range.*>= 0.9, < 0.10"):
            check_verl_version(version)


@pytest.mark.parametrize("block, message", [
    ({"controller": ""}, r"engine_kwargs\.rollmesh\.controller.*is required"),
    ({"controller": "no-port"}, r"engine_kwargs\.rollmesh\.controller"),
    ({"controller": "127.0.0.1:1", "stream_interval": 0}, r"engine_kwargs\.rollmesh\.stream_interval.*>= 1"),
    ({"controller": "127.0.0.1:1", "controler": "x"}, r"engine_kwargs\.rollmesh\.controler.*unknown key.*"
                                                      r"did you mean.*controller"),
])
def test_a_malformed_rollmesh_block_names_the_key(block, message):
    from mesh_runtime.config import ConfigError
    from rollmesh_verl.settings import mesh_settings

    with pytest.raises(ConfigError, match=message):
        mesh_settings(block)


def test_the_rollmesh_replica_needs_the_rollmesh_checkpoint_engine(rollmesh_fleet: Fleet):
    from mesh_runtime.config import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint_engine\.backend.*must be 'rollmesh'.*got 'nccl'"):
        _manager(verl_config(rollmesh_fleet, "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"))
