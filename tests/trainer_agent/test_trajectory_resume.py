"""A turn of a trajectory aborted on its replica resumes on another with its tokens so far: two synthetic
replicas behind a real balancer, an environment writing the user turn, and an abort in the middle of a
model turn. The trajectory keeps every token, the split turn shows as two segments."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mesh_runtime.chat import ChatTokenizer
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc
from tests.processes import running_server
from trainer_agent.driver.lb_client import LoadBalancerGenerate
from trainer_agent.driver.rollout_types import RolloutRequest
from trainer_agent.driver.settings import MultiTurnSettings
from trainer_agent.driver.trajectory import Environment, TrajectoryRunner

pytestmark = pytest.mark.timeout(180)

AGENT = """node_id: {node}
backend: synthetic
engine_options: {{tokens_per_second: 40, tokens_per_step: 1, vocab_size: 256,
                  lengths: {{kind: fixed, value: 40}}}}
replicas: [{{replica_id: {node}-s0}}]
"""


class OneMore(Environment):
    async def user_turn(self, messages, context):
        return "go on" if sum(m["role"] == "user" for m in messages) < 2 else None


def test_an_aborted_turn_resumes_with_its_tokens(tmp_path):
    for node in ("a", "b"):
        (tmp_path / f"{node}.yaml").write_text(AGENT.format(node=node))
    with running_server("replica-agent", ["--config", str(tmp_path / "a.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp_path / "a.log") as (a, _), \
            running_server("replica-agent", ["--config", str(tmp_path / "b.yaml"), "--listen", "127.0.0.1:0"],
                           log_path=tmp_path / "b.log") as (b, _):
        (tmp_path / "lb.yaml").write_text(f"replicas:\n  - {{replica_id: a-s0, address: '{a}'}}\n"
                                          f"  - {{replica_id: b-s0, address: '{b}'}}\n")
        with running_server("lb", ["--config", str(tmp_path / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp_path / "lb.log") as (lb, _):
            asyncio.run(_run(lb, {"a-s0": a, "b-s0": b}))


async def _run(lb: str, agents: dict[str, str]) -> None:
    tokenizer = ChatTokenizer.from_model("tiny-llama")
    settings = MultiTurnSettings(enable=True, environment="tests.trainer_agent.test_trajectory_resume:OneMore",
                                 max_assistant_turns=2)
    messages = [{"role": "user", "content": "start"}]
    runner = TrajectoryRunner(tokenizer, settings, max_response_tokens=200, environment=OneMore(),
                              context_of=lambda prompt_id: {"messages": messages})
    prompt = tokenizer.encode_chat(messages)
    request = RolloutRequest(request_id="g#0/0", prompt_token_ids=prompt, session_id="g#0",
                                partial_rollout=True, param_version=0, max_tokens=200, stop_token_ids=[1])
    async with grpc.aio.insecure_channel(lb) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        trajectory = asyncio.create_task(runner.run("g#0", 0, request, LoadBalancerGenerate(stub, timeout_s=60)))
        busy = None
        while busy is None:   # a model turn is being generated: abort it on its replica
            await asyncio.sleep(0.3)
            routed = await stub.ListReplicas(loadbalancer_pb2.ListReplicasRequest())
            busy = next((r.endpoint.replica_id for r in routed.replicas if r.in_flight), None)
        async with grpc.aio.insecure_channel(agents[busy]) as agent_channel:
            reply = await replica_agent_pb2_grpc.ReplicaAgentServiceStub(agent_channel).AbortRequests(
                replica_agent_pb2.AbortRequestsRequest(replica_id=busy, all=True))
        assert reply.aborted_request_ids
        sample = await trajectory
    assert (sample.assistant_turns, sample.user_turns) == (2, 1)
    # two model turns and one user turn, one model turn split where it was aborted: four segments
    assert len(sample.segment_lengths) == 4 and sample.weight_versions.count(-1) == 1
    assert sum(sample.segment_lengths) == len(sample.completion_ids) == len(sample.loss_mask)
    user = sample.weight_versions.index(-1)
    start = sum(sample.segment_lengths[:user])
    rendered = tokenizer.decode(sample.completion_ids[start:start + sample.segment_lengths[user]],
                                skip_special_tokens=False)
    assert rendered == "<|user|>go on</s><|assistant|>"
    assert sample.loss_mask.count(0) == sample.segment_lengths[user]
