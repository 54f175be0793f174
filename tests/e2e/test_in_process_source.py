"""A trainer process that serves its own weights (trainer_agent.in_process): no trainer agent, no file.

The controller starts with no trainer address; the trainer hands each version to its InProcessWeightServer and
names it in SyncWeights (source_address). The broadcast is the trainer agent's own: both replicas take the first
version in full and the next as a delta, bit for bit (each replica checks the manifest's checksum of the whole
result), greedy outputs follow the weights, and the controller keeps the address for the syncs that name none.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from mesh_runtime.durations import set_seconds
from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from rollmesh.controller.v1 import controller_pb2_grpc, weight_sync_pb2
from tests.controller.scaling.helpers import Procs, generate, lb_stub, replicas, until
from trainer_agent.in_process import InProcessWeightServer
from trainer_agent.weight_source import TorchWeightSource

pytestmark = pytest.mark.timeout(240)
AGENT = """node_id: a
backend: torch
model: tiny-llama
slots: 2
controller_address: {controller}
replicas:
  - {{replica_id: a-s0, kind: STANDALONE}}
  - {{replica_id: a-s1, kind: STANDALONE}}
"""


def _weights() -> dict[str, torch.Tensor]:
    source = TorchWeightSource("tiny-llama")
    source.load()
    return {n: t.clone() for n, t in source.named_weights()}


async def _sync(stub, version: int, source: str = "") -> weight_sync_pb2.WeightSyncResult:
    request = weight_sync_pb2.SyncWeightsRequest(weight_version=version, request_id=f"v{version}-{source}",
                                                 source_address=source)
    set_seconds(request.timeout, 60)
    return (await stub.SyncWeights(request, timeout=90)).result


async def test_the_fleet_takes_versions_from_the_trainers_own_process(tmp_path):
    procs = Procs(tmp_path)
    server = InProcessWeightServer()
    try:
        lb = procs.start("lb", "lb", "")
        controller = procs.start("controller", "controller", f"load_balancer_address: {lb}\n"
                                                             f"state_dir: {tmp_path / 'state'}\n")
        procs.start("a", "replica-agent", AGENT.format(controller=controller))
        address = server.start()
        with pytest.raises(FailedPrecondition, match="not loaded"):
            server.source.snapshot()   # nothing handed over yet: a prepare fails, it invents nothing
        async with grpc.aio.insecure_channel(controller) as channel, grpc.aio.insecure_channel(lb) as balancer:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)

            async def registered() -> bool:
                return len(await replicas(stub)) == 2
            await until(registered, 60, what="both replicas to register")
            before = (await generate(lb_stub(balancer), "before", 8)).segments[0].token_ids

            base = _weights()
            generator = torch.Generator().manual_seed(1)
            one = {n: t + torch.randn(t.shape, generator=generator) * 0.2 for n, t in base.items()}
            server.hand_over(one, 1)
            first = await _sync(stub, 1, address)
            assert [r.ok for r in first.replica_results] == [True, True], first
            full = first.bytes_sent
            assert full >= sum(t.numel() * 4 for t in base.values())
            assert {r.weight_version for r in (await replicas(stub)).values()} == {1}
            after = (await generate(lb_stub(balancer), "after", 8)).segments[0].token_ids
            assert after != before   # the replicas serve the handed-over weights

            two = dict(one)
            two["model.norm.weight"] = one["model.norm.weight"] + 1.0   # one small tensor changes
            server.hand_over(two, 2)
            second = await _sync(stub, 2)   # no address named: the controller kept the last one
            assert [r.ok for r in second.replica_results] == [True, True], second
            assert second.bytes_sent < full / 10, (second.bytes_sent, full)   # a delta from version 1

            with pytest.raises(InvalidArgument, match="model.norm.weight"):
                server.hand_over({"model.norm.weight": torch.zeros(3)}, 3)
            assert server.weight_version == 2   # nothing changed

            server.close()   # the trainer went away: the sync says where it looked
            third = await _sync(stub, 2 + 1)
            assert all(not r.ok and "UNAVAILABLE" in r.error_message for r in third.replica_results), third
            assert {r.weight_version for r in (await replicas(stub)).values()} == {2}
    finally:
        server.close()
        procs.close()
