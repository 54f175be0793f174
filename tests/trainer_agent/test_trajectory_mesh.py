"""A multi-turn trajectory through a real balancer and a real torch replica: a tiny model fitted to call a
tool (tests/openai_api/tool_model.py) calls a tool written for verl, gets its answer and goes on; the ids of
its turn are the engine's own, and the trajectory's CloseSession reaches the replica that cached it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import yaml

from mesh_runtime.chat import ChatTokenizer
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from tests.openai_api.tool_model import ANSWER, MESSAGES, TOOLS, fit_tool_model
from tests.processes import running_server
from trainer_agent.driver.lb_client import LoadBalancerGenerate
from trainer_agent.driver.rollout_types import RolloutRequest
from trainer_agent.driver.settings import MultiTurnSettings
from trainer_agent.driver.tools import ToolBox, load_tools
from trainer_agent.driver.trajectory import TrajectoryRunner

pytestmark = pytest.mark.timeout(240)


def test_a_trajectory_on_a_real_mesh(tmp_path):
    model = fit_tool_model(tmp_path / "model")
    (tmp_path / "agent.yaml").write_text(f"node_id: a\nbackend: torch\nmodel: {model}\n"
                                         "engine_options: {num_threads: 1}\nreplicas: [{replica_id: a-s0}]\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "tests.trainer_agent.verl_tools.LookupTool",
                                                "config": {"type": "native", "table": {"x": "42"}},
                                                "tool_schema": TOOLS[0]}]}, sort_keys=False))
    with running_server("replica-agent", ["--config", str(tmp_path / "agent.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp_path / "agent.log") as (agent, _):
        (tmp_path / "lb.yaml").write_text(f"replicas: [{{replica_id: a-s0, address: '{agent}'}}]\n")
        with running_server("lb", ["--config", str(tmp_path / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp_path / "lb.log") as (lb, _):
            asyncio.run(_trajectory(lb, agent, model, tools))


async def _trajectory(lb: str, agent: str, model, tools) -> None:
    tokenizer = ChatTokenizer.from_model(str(model))
    settings = MultiTurnSettings(enable=True, tool_config_path=str(tools), max_assistant_turns=2)
    toolbox = ToolBox(load_tools(tools), timeout_s=5, max_response_length=256, truncate_side="middle")
    closed = []
    async with grpc.aio.insecure_channel(lb) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)

        async def close_session(session_id: str) -> None:
            closed.append(await stub.CloseSession(loadbalancer_pb2.CloseSessionRequest(session_id=session_id)))

        runner = TrajectoryRunner(tokenizer, settings, max_response_tokens=200, toolbox=toolbox,
                                  close_session=close_session)
        prompt = tokenizer.encode_chat(MESSAGES, tools=runner.tool_schemas)
        request = RolloutRequest(request_id="g#0/0", prompt_token_ids=prompt, session_id="g#0",
                                    partial_rollout=True, param_version=0, max_tokens=200, temperature=0.0,
                                    stop_token_ids=[tokenizer.eos_token_id])
        sample = await runner.run("g#0", 0, request, LoadBalancerGenerate(stub, timeout_s=60))

    direct = await _engine_ids(agent, prompt)
    turn1 = direct[:direct.index(tokenizer.eos_token_id) + 1]
    assert tokenizer.decode(turn1) == ANSWER
    assert sample.completion_ids[:len(turn1)] == turn1                       # the engine's own ids
    tool_ids = tokenizer.encode("<|user|><tool_response>42</tool_response></s><|assistant|>",
                                add_special_tokens=False)
    assert sample.completion_ids[len(turn1):len(turn1) + len(tool_ids)] == tool_ids
    mask = sample.loss_mask
    assert mask[:len(turn1)] == [1] * len(turn1) and mask[len(turn1):len(turn1) + len(tool_ids)] == [0] * len(tool_ids)
    assert all(m == 1 for m in mask[len(turn1) + len(tool_ids):])
    assert sample.assistant_turns == 2 and sample.tool_calls == 1 and sample.tool_errors == 0
    assert [v for v in sample.weight_versions if v != -1] == [0, 0]
    [reply] = closed
    assert reply.replica_id == "a-s0" and reply.released    # the engine had the trajectory's turns cached


async def _engine_ids(agent: str, prompt: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(agent) as channel:
        stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        ids: list[int] = []
        async for msg in stub.Generate(replica_agent_pb2.GenerateRequest(
                replica_id="a-s0", request_id="direct", prompt_token_ids=prompt,
                sampling_params=generation_pb2.SamplingParams(max_tokens=80, temperature=0)), timeout=60):
            ids.extend(msg.token_ids)
        return ids
