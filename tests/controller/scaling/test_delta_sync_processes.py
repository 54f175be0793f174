"""Delta weight versions on a real mesh: trainer agent (float32 weights served as bf16), controller, a torch
replica agent serving bf16, gloo on loopback.

Versions are published as files (DirectoryWeightSource), each a small update of the last. The second sync
goes out as a delta; a replica that missed versions gets one delta composed of the ones since its version where
the trainer keeps them, else a full copy from a peer that holds the new one; every replica's weights are
checked, byte for byte, against the published version cast to bf16.
"""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import pytest
import torch

from rollmesh.controller.v1 import weight_sync_pb2
from rollmesh.weights.v1 import weight_source_pb2 as ws
from rollmesh.weights.v1 import weight_source_pb2_grpc
from tests.controller.scaling.helpers import Procs, controller_stub, replicas, until
from tests.processes import clean_env
from weight_transfer.published import publish

pytestmark = pytest.mark.timeout(300)
REPLICAS = ("a-s0", "a-s1", "a-s2", "a-s3")
ON_B = ("b-s0", "b-s1")
ALL = REPLICAS + ON_B
TRAINER = """model: tiny-llama
served_dtype: bfloat16
weight_source: trainer_agent.published_weights:DirectoryWeightSource
weight_source_options: {{directory: {weights}}}
weight_transfer: {{gloo_interface: lo, bucket_size_bytes: 65536, delta_history: {history}}}
"""
CONTROLLER = """load_balancer_address: {lb}
trainer_address: {trainer}
lease_ttl_s: 10
load_report_interval_s: 0.3
async_training: {{weight_sync_timeout_s: 60}}
"""
AGENT = """node_id: {node}
backend: torch
model: tiny-llama
slots: 4
controller_address: {controller}
engine_options: {{dtype: bfloat16, max_batch_size: 8, delta_in_place: {in_place}}}
weight_transfer: {{gloo_interface: lo}}
replicas:
"""


def agent_config(node: str, replica_ids: tuple[str, ...], controller: str, in_place: bool = True) -> str:
    return AGENT.format(node=node, controller=controller, in_place=str(in_place).lower()) + "".join(
        f"  - {{replica_id: {r}, kind: STANDALONE}}\n" for r in replica_ids)


async def _hand_made_delta(trainer: str, agent: str, *, version: int, base: int, receivers: list[str]) -> None:
    """Prepare ``version`` as a delta from ``base`` on the trainer and run it to ``receivers`` by hand."""
    import asyncio

    from rollmesh.common.v1 import weights_pb2
    from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
    from rollmesh.replica.v1 import replica_agent_pb2_grpc

    async with grpc.aio.insecure_channel(trainer) as tch, grpc.aio.insecure_channel(agent) as ach:
        source = weight_source_pb2_grpc.WeightSourceServiceStub(tch)
        prepared = await source.PrepareWeightSync(ws.PrepareWeightSyncRequest(weight_version=version,
                                                                              delta_base_version=base))
        assert prepared.HasField("delta") and prepared.delta.base_version == base
        plan = weights_pb2.WeightSyncPlan(
            sync_id=f"hand-{version}", weight_version=version, group_id=f"hand-{version}",
            rendezvous_host=prepared.rendezvous_host, rendezvous_port=prepared.rendezvous_port,
            world_size=len(receivers) + 1, backend=weights_pb2.PROCESS_GROUP_BACKEND_GLOO, source=prepared.source,
            manifest=prepared.manifest, delta=prepared.delta,
            members=[weights_pb2.WeightSyncMember(rank=0)] +
                    [weights_pb2.WeightSyncMember(rank=i + 1, replica_id=r) for i, r in enumerate(receivers)])
        plan.timeout.FromSeconds(60)
        sent, received = await asyncio.gather(
            source.SendWeights(ws.SendWeightsRequest(plan=plan)),
            replica_agent_pb2_grpc.ReplicaAgentServiceStub(ach).ReceiveWeights(
                agent_pb.ReceiveWeightsRequest(replica_ids=receivers, plan=plan, abort_in_flight=True)))
    assert sent.bytes_sent == prepared.delta.stream.total_bytes
    results = {r.replica_id: r for r in received.results}
    assert results[receivers[0]].checksum_ok and not results[receivers[0]].delta_base_missing
    for missing in (results[r] for r in receivers[1:]):
        assert not missing.checksum_ok and missing.delta_base_missing and missing.weight_version != version


async def _install(agent: str, replica_id: str, directory: Path, version: int) -> None:
    """Load the checkpoint in ``directory`` into a replica as ``version`` (whatever it holds)."""
    from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
    from rollmesh.replica.v1 import replica_agent_pb2_grpc

    async with grpc.aio.insecure_channel(agent) as channel:
        reply = await replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel).LoadCheckpoint(
            agent_pb.LoadCheckpointRequest(replica_ids=[replica_id], checkpoint_path=str(directory),
                                           weight_version=version, step=agent_pb.CHECKPOINT_STEP_INSTALL))
    assert reply.results[0].checksum_ok and reply.results[0].weight_version == version, reply


async def _sleep(agent: str, replica_id: str, level: int) -> None:
    from rollmesh.common.v1 import types_pb2
    from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
    from rollmesh.replica.v1 import replica_agent_pb2_grpc

    async with grpc.aio.insecure_channel(agent) as channel:
        await replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel).Sleep(agent_pb.SleepRequest(
            replica_id=replica_id, level=types_pb2.SLEEP_LEVEL_1 if level == 1 else types_pb2.SLEEP_LEVEL_2,
            abort_in_flight=True))


async def _wake(agent: str, replica_id: str) -> None:
    from rollmesh.replica.v1 import replica_agent_pb2 as agent_pb
    from rollmesh.replica.v1 import replica_agent_pb2_grpc

    async with grpc.aio.insecure_channel(agent) as channel:
        await replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel).WakeUp(agent_pb.WakeUpRequest(
            replica_id=replica_id, resume_generation=True))


def versions_of(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` float32 versions of tiny-llama's weights, each an update of lr 1e-5 on the last."""
    from trainer_agent.weight_source import TorchWeightSource

    source = TorchWeightSource("tiny-llama")
    source.load()
    current = {name: tensor.clone() for name, tensor in source.named_weights()}
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        current = {name: t - 1e-5 * torch.sign(torch.randn(t.shape, generator=gen)) for name, t in current.items()}
        out.append(current)
    return out


async def served_checksum(agent: str, replica_id: str) -> tuple[int, list[tuple[str, tuple[int, ...]]], str]:
    """What the replica serves, as its agent lays it out for a seed sync: version, tensor order, sha256."""
    async with grpc.aio.insecure_channel(agent) as channel:
        prepared = await weight_source_pb2_grpc.WeightSourceServiceStub(channel).PrepareWeightSync(
            ws.PrepareWeightSyncRequest(source_id=replica_id, bucket_size_bytes=65536, checksum_algorithm="sha256"))
    return prepared.weight_version, [t.name for t in prepared.manifest.tensors], prepared.manifest.checksum


def expected_checksum(tensors: dict[str, torch.Tensor], order: list[str]) -> str:
    from weight_transfer import build_manifest

    served = [(name, tensors[name].to(torch.bfloat16)) for name in order]
    return build_manifest(served, 65536, checksum_algorithm="sha256").checksum


async def sync_to(ctl, weights: Path, published: list[dict[str, torch.Tensor]], version: int,
                  replica_ids=()) -> weight_sync_pb2.WeightSyncResult:
    """Publish ``version`` and sync it to ``replica_ids`` (none: every replica); every replica must succeed."""
    publish(weights, published[version - 1], version)
    reply = await ctl.SyncWeights(weight_sync_pb2.SyncWeightsRequest(weight_version=version,
                                                                     replica_ids=list(replica_ids)))
    assert all(r.ok for r in reply.result.replica_results), reply.result
    return reply.result


async def check_served(agents: dict[str, str], published: list[dict[str, torch.Tensor]], version: int,
                       replica_ids=REPLICAS) -> None:
    """Each replica (on the agent its id's first letter names) serves ``version``, bit for bit."""
    for replica_id in replica_ids:
        held, order, checksum = await served_checksum(agents[replica_id[0]], replica_id)
        assert held == version
        assert checksum == expected_checksum(published[version - 1], order), replica_id


def copies_of(result: weight_sync_pb2.WeightSyncResult) -> dict[str, tuple[str, str]]:
    return {r.replica_id: (r.copy, r.source) for r in result.replica_results}


async def test_deltas_and_peer_copies_leave_every_replica_bit_identical_to_a_full_copy(tmp_path: Path):
    weights = tmp_path / "weights"
    published = versions_of(11, 10)
    procs = Procs(tmp_path, env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    try:
        lb = procs.start("lb", "lb", "")
        # no deltas of older versions kept: a replica that missed one takes a full copy (from a peer)
        trainer = procs.start("trainer", "trainer-agent", TRAINER.format(weights=weights, history=0))
        controller = procs.start("controller", "controller", CONTROLLER.format(lb=lb, trainer=trainer))
        agent = procs.start("a", "replica-agent", agent_config("a", REPLICAS, controller))
        agents = {"a": agent, "b": procs.start("b", "replica-agent", agent_config("b", ON_B, controller))}
        async with grpc.aio.insecure_channel(controller) as channel:
            ctl = controller_stub(channel)
            await until(lambda: _all_registered(ctl))

            sync = functools.partial(sync_to, ctl, weights, published)
            check = functools.partial(check_served, agents, published)

            first = await sync(1)   # nothing to diff against yet
            assert {r.copy for r in first.replica_results} == {"full"} and first.delta_base_version == -1
            await check(1, ALL)

            second = await sync(2)
            assert second.delta_base_version == 1
            assert {r.replica_id: r.copy for r in second.replica_results} == dict.fromkeys(ALL, "delta")
            assert 0 < second.delta_density < 0.2 and second.delta_bytes < second.full_bytes / 2
            assert second.bytes_sent == second.delta_bytes
            await check(2, ALL)

            third = await sync(3, ["a-s0"])   # the others miss version 3
            assert [(r.replica_id, r.copy) for r in third.replica_results] == [("a-s0", "delta")]
            await check(3, ["a-s0"])

            fourth = await sync(4)
            copies = copies_of(fourth)
            assert copies["a-s0"][0] == "delta" and fourth.delta_base_version == 3
            # one chain from the only peer at the version: node a's replicas, then node b's (not the trainer)
            assert {copies[r] for r in ALL if r != "a-s0"} == {("peer", "a-s0")}
            assert fourth.bytes_sent == fourth.delta_bytes + fourth.full_bytes
            assert (await replicas(ctl))["a-s1"].weight_version == 4
            await check(4, ALL)

            # A peer at the version on each node: each node's replicas behind take one copy from it, both at once.
            await sync(5, ["a-s0", "b-s0"])
            split = await sync(6)
            copies = copies_of(split)
            assert copies["a-s0"][0] == copies["b-s0"][0] == "delta"
            assert {r: copies[r] for r in ("a-s1", "a-s2", "a-s3", "b-s1")} == {
                "a-s1": ("peer", "a-s0"), "a-s2": ("peer", "a-s0"), "a-s3": ("peer", "a-s0"), "b-s1": ("peer", "b-s0")}
            assert split.bytes_sent == split.delta_bytes + 2 * split.full_bytes
            await check(6, ALL)

            # Hybrid replicas waking: asleep at level 1 (weights kept on the host) a replica takes the delta;
            # asleep at level 2 (weights discarded) it needs a full copy, and gets it from a peer.
            seventh = await sync(7)
            assert {r.copy for r in seventh.replica_results} == {"delta"}
            await _sleep(agent, "a-s2", level=1)
            await _sleep(agent, "a-s0", level=2)
            eighth = await sync(8, REPLICAS)
            copies = copies_of(eighth)
            assert copies["a-s1"][0] == copies["a-s2"][0] == "delta" and copies["a-s0"] == ("peer", "a-s1")
            for replica_id in ("a-s2", "a-s0"):
                await _wake(agent, replica_id)
            await check(8)

            # A delta plan reaching a replica that does not serve its base (the registry can be wrong after a
            # restart): it receives the stream with the others, keeps its weights and says it needs a full copy,
            # whether its version says so (a-s0, at 8) or only its weights do (a-s3, version 8's weights
            # installed as 9: the rebuilt weights fail the target's check, then its weights the base's).
            await sync(9, ["a-s1"])
            publish(tmp_path / "not-9", published[7], 9)
            await _install(agent, "a-s3", tmp_path / "not-9", 9)
            publish(weights, published[9], 10)
            await _hand_made_delta(trainer, agent, version=10, base=9, receivers=["a-s1", "a-s0", "a-s3"])
            await check(10, ["a-s1"])
            await check(8, ["a-s0", "a-s2"])
            held, order, checksum = await served_checksum(agent, "a-s3")
            assert held == 9 and checksum == expected_checksum(published[7], order)   # its weights kept
    finally:
        procs.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "packed-copy"])
async def test_replicas_that_missed_versions_catch_up_by_one_composed_delta(tmp_path: Path, in_place: bool):
    """The trainer keeps its last deltas: replicas two and three versions behind, and one that slept through
    a version, each take one delta from the version they hold, and serve the new version bit for bit; applied
    where the engine's weights lie, or (as engines that cannot lend them do) to a packed copy then loaded."""
    weights = tmp_path / "weights"
    published = versions_of(12, 7)
    procs = Procs(tmp_path, env=clean_env(GLOO_SOCKET_IFNAME="lo"))
    try:
        lb = procs.start("lb", "lb", "")
        trainer = procs.start("trainer", "trainer-agent", TRAINER.format(weights=weights, history=8))
        controller = procs.start("controller", "controller", CONTROLLER.format(lb=lb, trainer=trainer))
        agent = procs.start("a", "replica-agent", agent_config("a", REPLICAS, controller, in_place))
        async with grpc.aio.insecure_channel(controller) as channel:
            ctl = controller_stub(channel)
            await until(lambda: _registered(ctl, REPLICAS))

            sync = functools.partial(sync_to, ctl, weights, published)
            check = functools.partial(check_served, {"a": agent}, published)

            await sync(1)
            await sync(2)
            await sync(3, ["a-s0", "a-s1"])       # a-s2, a-s3 miss 3
            await sync(4, ["a-s0"])               # and a-s1 misses 4
            copies = copies_of(await sync(5))     # a-s0 from 4, a-s1 from 3, a-s2 and a-s3 from 2
            assert {copy for copy, _ in copies.values()} == {"delta"}, copies
            await check(5)
            await _sleep(agent, "a-s2", level=1)  # a hybrid replica lent back, asleep through version 6
            await sync(6, ["a-s0", "a-s1", "a-s3"])
            await _wake(agent, "a-s2")
            copies = copies_of(await sync(7))
            assert copies["a-s2"][0] == "delta" and {copy for copy, _ in copies.values()} == {"delta"}, copies
            await check(7)
        applied = [line for line in (tmp_path / "a.log").read_text().splitlines() if " of a delta from " in line]
        assert applied and all(line.endswith("s)") for line in applied)
        assert all((" in place " in line) == in_place for line in applied), applied[:2]
    finally:
        procs.close()


async def _registered(ctl, replica_ids) -> bool:
    return set(replica_ids) <= set(await replicas(ctl))


async def _all_registered(ctl) -> bool:
    return set(await replicas(ctl)) == set(ALL)
