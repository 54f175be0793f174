"""verl's own clients and agent loops generate through a real rollmesh fleet (verl 0.9 from PyPI, a local Ray
cluster): verl's ``FullyAsyncLLMServerManager`` builds ``rollmesh`` replicas through its registry, its
``FullyAsyncLLMServerClient`` and agent loops (single-turn, and the tool agent loop with the multi-turn example's
tool) call them; ids and logprobs are the engine's; an abort returns the partial tokens and verl's client resumes
them; a replica agent SIGKILLed mid-rollout costs no request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import torch

from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from rollmesh.common.v1 import generation_pb2
from trainer_client import MeshClient

from .conftest import AGENTIC, ROOT, verl_config
from .fleet import Fleet

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_cluster")]

PROMPT = [5, 72, 101, 108, 108, 111]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@pytest.fixture(scope="module")
def manager(rollmesh_fleet: Fleet) -> Any:
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager

    return FullyAsyncLLMServerManager.create(config=verl_config(rollmesh_fleet), worker_group=None)


def _client(manager: Any, resuming: bool = True) -> Any:
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

    return manager.get_client(client_cls=FullyAsyncLLMServerClient if resuming else LLMServerClient)


async def _direct(f: Fleet, prompt: list[int], max_tokens: int) -> loadbalancer_pb2.GenerateResponse:
    """The same greedy generation straight through rollmesh's own client."""
    async with MeshClient(f.controller) as mesh:
        channel = await mesh.generation_channel(f.lb)
        try:
            return await mesh.generate(channel, loadbalancer_pb2.GenerateRequest(
                request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt,
                sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True)))
        finally:
            await channel.close()


def test_verl_builds_rollmesh_replicas_through_its_registry(manager):
    from rollmesh_verl.replica import RollmeshReplica

    replicas = manager.get_replicas()
    assert len(replicas) == 2 and all(isinstance(r, RollmeshReplica) for r in replicas)
    assert all(r.workers == r.servers == [r.server_handle] for r in replicas)


async def test_verls_client_gets_the_engines_tokens_and_logprobs(manager, rollmesh_fleet):
    greedy = {**SAMPLING, "temperature": 0.0}
    out = await _client(manager).generate("greedy", prompt_ids=PROMPT, sampling_params={**greedy, "max_tokens": 12})
    direct = await _direct(rollmesh_fleet, PROMPT, 12)
    assert out.token_ids == list(direct.token_ids) and len(out.token_ids) == 12
    assert out.log_probs == pytest.approx(list(direct.logprobs), abs=1e-6)
    assert out.stop_reason == "length"   # verl's client: the token budget is spent
    assert out.extra_fields["global_steps"] == out.extra_fields["min_global_steps"] == 0

    sampled = await asyncio.gather(*(_client(manager, resuming=False).generate(
        f"s{i}", prompt_ids=PROMPT, sampling_params={**SAMPLING, "max_tokens": 8, "seed": i}) for i in range(16)))
    assert all(o.stop_reason == "completed" and len(o.token_ids) == len(o.log_probs) == 8 for o in sampled)
    assert all(o.extra_fields["weight_versions"] == [0] * 8 for o in sampled)
    assert len({tuple(o.token_ids) for o in sampled}) > 1   # seeded sampling, not greedy


async def test_the_fleets_logprobs_equal_verls_recomputation_in_verls_environment(manager, rollmesh_fleet):
    """verl's actor recomputes old log-probabilities with the transformers verl pins (5.10.x here, below rollmesh's
    own floor): sampled tokens' rollout logprobs from the fleet (transformers of rollmesh's pins) agree with a
    one-pass forward of the same model in verl's environment, as the engine and rollmesh's trainer agree."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rollmesh_fleet.model, local_files_only=True).eval()
    outs = await asyncio.gather(*(_client(manager, resuming=False).generate(
        f"agree{i}", prompt_ids=PROMPT, sampling_params={**SAMPLING, "max_tokens": 16, "seed": 100 + i})
        for i in range(4)))
    worst = 0.0
    for out in outs:
        ids = torch.tensor([PROMPT + list(out.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(PROMPT) - 1:-1]
        mine = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, len(PROMPT):, None])[:, 0]
        worst = max(worst, float((mine - torch.tensor(out.log_probs)).abs().max()))
    assert worst <= 1e-4, f"the fleet's and verl's logprobs differ by {worst:.3g} nats at most"


async def test_a_sampling_parameter_that_changes_output_is_refused_by_name(manager):
    with pytest.raises(Exception, match="repetition_penalty.*not supported"):
        await _client(manager).generate("rp", prompt_ids=PROMPT, sampling_params={**SAMPLING,
                                                                                  "repetition_penalty": 1.2})
    with pytest.raises(Exception, match="unknown sampling parameter 'typical_p'"):
        await _client(manager).generate("tp", prompt_ids=PROMPT, sampling_params={**SAMPLING, "typical_p": 0.9})


def _batch(rows: list[dict[str, Any]], agent: str) -> Any:
    from verl.protocol import DataProto

    return DataProto.from_single_dict({
        "raw_prompt": np.array([r["prompt"] for r in rows], dtype=object),
        "agent_name": np.array([agent] * len(rows), dtype=object),
        "data_source": np.array([r["data_source"] for r in rows], dtype=object),
        "reward_model": np.array([r["reward_model"] for r in rows], dtype=object),
        "extra_info": np.array([r["extra_info"] for r in rows], dtype=object),
        "tools_kwargs": np.array([r["extra_info"]["tools_kwargs"] for r in rows], dtype=object),
    })


def _rows(n: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(ROOT / "examples" / "data" / "multiturn_lookup.parquet").to_pylist()[:n]


def test_verls_single_turn_agent_loop_generates_through_the_fleet(manager):
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager

    loops = FullyAsyncAgentLoopManager.create(config=manager.config, llm_client=_client(manager))
    out = loops.generate_sequences(_batch(_rows(4), "single_turn_agent"))
    assert out.batch["responses"].shape[0] == 4
    mask = out.batch["response_mask"].bool()
    assert bool(mask.any()) and bool((out.batch["rollout_log_probs"][mask] < 0).all())
    assert list(out.non_tensor_batch["global_steps"]) == [0] * 4


@pytest.fixture(scope="module")
def tool_fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A fleet of the multi-turn example's model (tiny-llama fitted to write Hermes tool calls)."""
    from .fleet import fleet

    with fleet(tmp_path_factory.mktemp("tool-fleet"), agents=1,
               model=str(ROOT / "examples" / "models" / "tool-format")) as f:
        yield f


def test_verls_tool_agent_loop_calls_the_examples_tool_through_the_fleet(tool_fleet):
    """The multi-turn example's verl tool under verl's own ToolAgentLoop: trajectories call the tool through
    the model the fleet serves, the tool's answers are masked out of the loss, the model's tokens carry logprobs."""
    from verl.experimental.fully_async_policy.fully_async_rollouter import (FullyAsyncAgentLoopManager,
                                                                            FullyAsyncLLMServerManager)

    config = verl_config(tool_fleet, "actor_rollout_ref.rollout.multi_turn.enable=true",
                         f"actor_rollout_ref.rollout.multi_turn.tool_config_path={AGENTIC / 'tools.yaml'}",
                         "actor_rollout_ref.rollout.multi_turn.format=hermes",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                         "actor_rollout_ref.rollout.response_length=100", "data.max_response_length=100",
                         replicas=1)
    manager = FullyAsyncLLMServerManager.create(config=config, worker_group=None)
    loops = FullyAsyncAgentLoopManager.create(config=config, llm_client=manager.get_client())
    # the model calls the tool in about 15% of its first turns (measured: 5 of 32): 48 trajectories all
    # answering straight away would happen about 4 times in 10,000 runs
    out = loops.generate_sequences(_batch(_rows(48), "tool_agent"))
    turns = [int(t) for t in out.non_tensor_batch["__num_turns__"]]
    called = [i for i, t in enumerate(turns) if t > 2]   # user, assistant, tool, assistant...
    assert called, turns
    for i in called:   # the tool's answer sits between model turns, out of the loss
        mask = out.batch["response_mask"][i].tolist()
        first_zero = mask.index(0)
        assert 1 in mask[first_zero:], mask
        logprobs = out.batch["rollout_log_probs"][i]
        assert all(float(lp) < 0 for lp, m in zip(logprobs, mask) if m)



async def _until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _streaming(manager: Any, generations: int) -> bool:
    """Whether ``generations`` are in flight and every one of them has streamed tokens."""
    states = await asyncio.gather(*(r.server_handle.status.remote() for r in manager.get_replicas()))
    streamed = [n for s in states for n in s["streamed"]]
    return len(streamed) == generations and all(n > 0 for n in streamed)


async def test_an_abort_returns_partial_tokens_and_verls_client_resumes_them(manager):
    """verl's abort contract: in-flight generations end 'aborted' with what they streamed; verl's plain client
    hands that back, its fully-async client sends prompt + partial again once generation resumes."""
    long = {**SAMPLING, "max_tokens": 400}
    plain = asyncio.create_task(_client(manager, resuming=False).generate("ab1", prompt_ids=PROMPT,
                                                                          sampling_params=long))
    resumed = asyncio.create_task(_client(manager).generate("ab2", prompt_ids=PROMPT, sampling_params=long))
    await _until(lambda: _streaming(manager, 2), 60, "both generations to stream tokens")
    replicas = manager.get_replicas()
    await asyncio.gather(*(r.abort_all_requests() for r in replicas))
    partial = await asyncio.wait_for(plain, 30)
    assert partial.stop_reason == "aborted" and 0 < len(partial.token_ids) < 400
    assert len(partial.log_probs) == len(partial.token_ids) and partial.extra_fields["weight_versions"]
    assert not resumed.done()   # parked behind the closed gate until generation resumes
    await asyncio.gather(*(r.resume_generation() for r in replicas))
    whole = await asyncio.wait_for(resumed, 60)
    assert len(whole.token_ids) == len(whole.log_probs) == 400 and whole.stop_reason == "length"


async def test_requests_behind_a_rejecting_gate_come_back_aborted_at_once(manager):
    replicas = manager.get_replicas()
    await asyncio.gather(*(r.abort_all_requests(reject_request=True) for r in replicas))
    try:
        out = await asyncio.wait_for(_client(manager, resuming=False).generate(
            "rej", prompt_ids=PROMPT, sampling_params={**SAMPLING, "max_tokens": 4}), 10)
        assert out.stop_reason == "aborted" and out.token_ids == []
    finally:
        await asyncio.gather(*(r.resume_generation() for r in replicas))
    out = await _client(manager).generate("after", prompt_ids=PROMPT, sampling_params={**SAMPLING, "max_tokens": 4})
    assert len(out.token_ids) == 4
