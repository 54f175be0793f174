"""No call is retried by two layers, counted end to end: the trainer's rollouter in front of a real balancer
(in-process, gRPC on loopback) in front of scripted replicas.

A request the balancer already retried until its budget was spent comes back ``non_retryable``, and the
rollouter (``max_retries`` 2) does not send it again: the replicas see budget + 1 attempts, not
(budget + 1) x 3. A failure the balancer could not retry (the balancer itself unreachable) is the rollouter's
to retry, and it does, ``max_retries`` times."""

from __future__ import annotations

import grpc
import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.server import SPEC
from mesh_runtime.config import load_config
from mesh_runtime.generate_many import BalancerGenerations
from mesh_runtime.net import free_port
from mesh_runtime.retry import non_retryable
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2
from tests.loadbalancer.fake_replica import start_fake
from trainer_agent.driver import MessageQueue, Prompt, RolloutConfig, RolloutFailed, Rollouter
from trainer_agent.driver.lb_client import LoadBalancerGenerate

pytestmark = pytest.mark.timeout(60)


class Counted:
    """The rollouter's generate function, counting its calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    async def __call__(self, request):
        self.calls += 1
        return await self.inner(request)


async def rollout(generate, budget: int) -> tuple[Rollouter, BaseException]:
    config = RolloutConfig(n=1, ppo_mini_batch_size=1, max_retries=2, lb_retry_budget=budget, max_tokens=8)
    rollouter = Rollouter(config, MessageQueue(10), generate, [Prompt("p0", [1, 2, 3])], lambda: 1,
                          capacity_poll_interval=None)
    with pytest.raises(RolloutFailed) as info:
        await rollouter.run()
    return rollouter, info.value.__cause__


@pytest.mark.parametrize("path", ["Generate", "GenerateMany"])
async def test_a_spent_balancer_budget_is_not_retried_again_by_the_rollouter(path):
    """On a call per request and on the trainer's shared GenerateMany stream (where the flag travels in the
    item's status) alike."""
    fake_server, fake, address = await start_fake({"a": "abort", "b": "abort"})
    config = load_config(LoadBalancerConfig, None, overrides={"listen": "127.0.0.1:0",
                                                               "retry_initial_backoff_s": 0.01})
    lb, port = await SPEC.create(config, None)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
            await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
                routing_pb2.ReplicaEndpoint(replica_id=r, address=address) for r in ("a", "b")]))
            generations = BalancerGenerations(channel) if path == "GenerateMany" else None
            generate = Counted(LoadBalancerGenerate(stub, timeout_s=20, generations=generations))
            rollouter, cause = await rollout(generate, budget=3)
    finally:
        await lb.stop(0)
        await fake_server.stop(0)
    assert isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert non_retryable(cause) and "retry budget of 3" in cause.details()
    assert len(fake.seen) == 4                       # the balancer's 1 + 3, once
    assert generate.calls == 1 and rollouter.stats()["retries"] == 0


async def test_a_failure_the_balancer_could_not_retry_is_the_rollouters():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:   # no balancer there
        generate = Counted(LoadBalancerGenerate(loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel),
                                                timeout_s=5))
        rollouter, cause = await rollout(generate, budget=3)
    assert isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
    assert not non_retryable(cause)
    assert generate.calls == 3 and rollouter.stats()["retries"] == 2   # max_retries 2

