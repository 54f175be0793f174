"""WeightBroadcaster in-process: prepare, send to a receiver GroupCache, group reuse, checks before any byte."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from mesh_runtime.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument
from weight_transfer import GroupCache, WeightTransferConfig, build_manifest, receive_weights
from weight_transfer.wire import SyncPlan
from trainer_agent.broadcast import WeightBroadcaster
from trainer_agent.weight_source import TorchWeightSource

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
TRAINER = "trainer-t0"


def transfer_config(**overrides) -> WeightTransferConfig:
    values = dict(bucket_size_bytes=64 << 10, gloo_interface="lo", setup_timeout_s=30.0, op_timeout_s=30.0)
    values.update(overrides)
    return WeightTransferConfig(**values)


@pytest.fixture
async def broadcaster():
    source = TorchWeightSource("tiny-llama", seed=5, weight_version=7)
    source.load()
    sender = WeightBroadcaster(source, member_id=TRAINER, rendezvous=(HOST, 0), config=transfer_config())
    await sender.start()
    yield sender
    await sender.close()


@pytest.fixture
def receiver():
    with GroupCache("r1", transfer_config()) as cache:
        yield cache


def plan_for(sender: WeightBroadcaster, prepared, sync_id: str, **changes) -> SyncPlan:
    plan = SyncPlan(sync_id=sync_id, weight_version=prepared.weight_version, group_id="g", rendezvous=sender.rendezvous,
                    backend="gloo", manifest=prepared.manifest, timeout_s=30.0, source=TRAINER,
                    members=(TRAINER, "r1"))
    return dataclasses.replace(plan, **changes)


def receive(cache: GroupCache, plan: SyncPlan) -> dict[str, torch.Tensor]:
    group = cache.get(plan.group_id, plan.members, plan.rendezvous, plan.backend)
    return receive_weights(group, plan.manifest)


async def sync(sender, cache, plan):
    return await asyncio.gather(sender.send(plan), asyncio.to_thread(receive, cache, plan))


async def test_prepared_weights_arrive_intact_and_the_second_sync_reuses_the_group(broadcaster, receiver):
    prepared = await broadcaster.prepare()
    assert prepared.weight_version == 7
    assert prepared.manifest.checksum_algorithm == "wsum64" and prepared.manifest.bucket_size_bytes == 64 << 10
    sent, tensors = await sync(broadcaster, receiver, plan_for(broadcaster, prepared, "s1"))
    expected = dict(broadcaster.source.named_weights())
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)
    assert (sent.weight_version, sent.checksum, sent.group_reused) == (7, prepared.manifest.checksum, False)
    assert sent.bytes_sent == prepared.manifest.total_bytes

    again = await broadcaster.prepare(7)
    assert again is prepared  # same version and layout: no new snapshot, same manifest
    second, _ = await sync(broadcaster, receiver, plan_for(broadcaster, again, "s2"))
    assert second.group_reused and broadcaster.groups_built == 1 and receiver.constructions == 1

    started = time.monotonic()
    assert await broadcaster.send(plan_for(broadcaster, prepared, "s1")) == sent  # recorded, nothing sent
    assert time.monotonic() - started < 1


async def test_the_snapshot_stays_frozen_while_the_trainer_moves_on(broadcaster, receiver):
    source = broadcaster.source
    original = {name: t.clone() for name, t in source.named_weights()}
    prepared = await broadcaster.prepare(bucket_size_bytes=4096, checksum_algorithm="crc32")
    assert prepared.manifest.num_buckets > 10
    source.set_weights({name: torch.zeros_like(t) for name, t in original.items()}, weight_version=8)
    assert await broadcaster.prepare(7, bucket_size_bytes=4096, checksum_algorithm="crc32") is prepared
    _, tensors = await sync(broadcaster, receiver, plan_for(broadcaster, prepared, "frozen"))
    assert all(torch.equal(tensors[name], original[name]) for name in original)

    newer = await broadcaster.prepare()
    assert newer.weight_version == 8 and newer.manifest.checksum != prepared.manifest.checksum
    with pytest.raises(FailedPrecondition, match="holds weight version 8, not 7"):
        await broadcaster.prepare(7)


async def test_prepare_refuses_bad_arguments(broadcaster):
    with pytest.raises(InvalidArgument, match="weight_version"):
        await broadcaster.prepare(-1)
    with pytest.raises(InvalidArgument, match="bucket_size_bytes"):
        await broadcaster.prepare(bucket_size_bytes=0)
    with pytest.raises(InvalidArgument, match="checksum_algorithm"):
        await broadcaster.prepare(checksum_algorithm="md5")
    with pytest.raises(FailedPrecondition, match="holds weight version 7, not 3"):
        await broadcaster.prepare(3)
    assert broadcaster.prepared is None


async def test_every_mismatch_is_refused_before_any_group_or_byte(broadcaster):
    prepared = await broadcaster.prepare()
    other = build_manifest([("x", torch.zeros(4))], 4096)
    host, port = broadcaster.rendezvous
    cases = {
        "NOT_PLAN_SOURCE": dict(source="trainer-elsewhere", members=("trainer-elsewhere", "r1")),
        "VERSION_MISMATCH": dict(weight_version=8),
        "MANIFEST_MISMATCH": dict(manifest=other),
        "RENDEZVOUS_MISMATCH": dict(rendezvous=(host, port + 1 if port < 65535 else port - 1)),
    }
    for reason, changes in cases.items():
        started = time.monotonic()
        with pytest.raises(FailedPrecondition) as info:
            await broadcaster.send(plan_for(broadcaster, prepared, f"bad-{reason}", **changes))
        assert info.value.reason == reason
        assert time.monotonic() - started < 1
    assert broadcaster.groups_built == 0

    unprepared = WeightBroadcaster(broadcaster.source, member_id=TRAINER, rendezvous=(HOST, 0),
                                   config=transfer_config())
    await unprepared.start()
    try:
        with pytest.raises(FailedPrecondition, match="call PrepareWeightSync"):
            await unprepared.send(plan_for(unprepared, prepared, "unprepared"))
    finally:
        await unprepared.close()


async def test_one_broadcast_at_a_time_and_a_repeated_sync_id_joins_the_running_one(broadcaster, receiver):
    prepared = await broadcaster.prepare()
    plan = plan_for(broadcaster, prepared, "first")
    first = asyncio.ensure_future(broadcaster.send(plan))
    await asyncio.sleep(0)  # the send is now waiting for its receiver
    with pytest.raises(Aborted, match="'first' is in progress"):
        await broadcaster.send(plan_for(broadcaster, prepared, "second"))
    joined = asyncio.ensure_future(broadcaster.send(plan))
    await asyncio.to_thread(receive, receiver, plan)
    assert await first == await joined


async def test_a_receiver_that_never_comes_ends_in_deadline_exceeded():
    source = TorchWeightSource("tiny-llama")
    source.load()
    sender = WeightBroadcaster(source, member_id=TRAINER, rendezvous=(HOST, 0),
                               config=transfer_config(setup_timeout_s=3))
    await sender.start()
    try:
        prepared = await sender.prepare()
        with pytest.raises(DeadlineExceeded):
            await sender.send(plan_for(sender, prepared, "alone", timeout_s=1.0))
    finally:
        await sender.close()


async def test_a_newer_version_is_adopted_only_when_allowed(broadcaster):
    first = await broadcaster.prepare()
    with pytest.raises(FailedPrecondition, match="holds weight version 7, not 9"):
        await broadcaster.prepare(9)
    broadcaster.adopt_newer_versions = True
    with pytest.raises(FailedPrecondition, match="jumps from the trainer's 7 without a sync") as info:
        await broadcaster.prepare(150)   # garbage: it would freeze every later genuine version
    assert info.value.reason == "VERSION_JUMP" and broadcaster.source.weight_version == 7
    adopted = await broadcaster.prepare(8)
    assert adopted.weight_version == 8 == broadcaster.source.weight_version
    assert adopted.manifest == first.manifest  # the same weights, now published as version 8
    with pytest.raises(FailedPrecondition, match="holds weight version 8, not 7"):
        await broadcaster.prepare(7)  # older versions are never adopted


async def test_a_released_snapshot_must_be_prepared_again(broadcaster):
    prepared = await broadcaster.prepare()
    assert broadcaster.release() and broadcaster.prepared is None and not broadcaster.release()
    with pytest.raises(FailedPrecondition) as info:
        await broadcaster.send(plan_for(broadcaster, prepared, "released"))
    assert info.value.reason == "NOT_PREPARED"
    await broadcaster.close()
    with pytest.raises(FailedPrecondition, match="not started or is shutting down"):
        await broadcaster.prepare()


async def _step(sender: WeightBroadcaster, version: int, seed: int):
    """Train one step (a small change to 5% of the weights), publish ``version`` and prepare it with a delta from
    the version before, as the controller asks each step."""
    gen = torch.Generator().manual_seed(seed)
    weights = {name: t + 1e-3 * torch.sign(torch.randn(t.shape, generator=gen))
               * (torch.rand(t.shape, generator=gen) < 0.05) for name, t in sender.source.named_weights()}
    sender.source.set_weights(weights, version)
    return await sender.prepare(version, delta_base_version=version - 1)


@contextlib.asynccontextmanager
async def history_sender(delta_history: int):
    """A trainer at version 7 that keeps the deltas of its last ``delta_history`` versions."""
    source = TorchWeightSource("tiny-llama", seed=5, weight_version=7)
    source.load()
    sender = WeightBroadcaster(source, member_id=TRAINER, rendezvous=(HOST, 0),
                               config=transfer_config(delta_history=delta_history))
    await sender.start()
    try:
        await sender.prepare(7)
        yield sender
    finally:
        await sender.close()


async def test_a_replica_several_versions_behind_gets_one_delta_composed_of_the_kept_ones():
    from weight_transfer import views_of
    from weight_transfer.delta import apply_delta, check_stream, pack_stream

    async with history_sender(2) as sender:
        eight = (await _step(sender, 8, 8)).snapshot.tensors     # frozen: what a replica at 8 serves
        await _step(sender, 9, 9)
        await _step(sender, 10, 10)
        ten = await sender.prepare(10, delta_base_version=8)     # kept: 9 (from 8) and 10 (from 9)
        older = await sender.prepare(10, delta_base_version=7)   # 8 (from 7) was let go: delta_history 2
    composed = ten.deltas[8]
    assert composed is not None and composed.base_version == 8 and 7 not in older.deltas
    flat = pack_stream(ten.manifest, iter(eight))
    received = views_of(composed.manifest, pack_stream(composed.manifest, iter(composed.tensors)))
    apply_delta(ten.manifest, flat, composed.manifest, received)
    check_stream(ten.manifest, flat)
    assert torch.equal(flat, pack_stream(ten.manifest, iter(ten.snapshot.tensors)))   # version 10, bit for bit
    assert 0 < composed.stats.ratio < 0.5


async def test_deltas_from_older_versions_need_their_history():
    async with history_sender(0) as sender:
        for version in (8, 9):
            await _step(sender, version, version)
        nine = await sender.prepare(9, delta_base_version=7)
    assert nine.deltas.get(8) is not None and 7 not in nine.deltas
