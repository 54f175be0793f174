"""End to end: a sender in its own process, receivers in this one, real gloo over loopback."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import threading
import time
import traceback

import pytest
import torch

from weight_transfer import (
    ChecksumMismatch,
    GroupBusy,
    GroupCache,
    ManifestMismatch,
    PeerLost,
    TransferCancelled,
    TransferTimeout,
    build_manifest,
    receive_weights,
    receive_weights_async,
    send_weights,
    send_weights_async,
    validate_against,
)

from .helpers import (
    BUCKET,
    HOST,
    InProcessMesh,
    SenderPlan,
    SpawnedSender,
    assert_same_tensors,
    expected_spec,
    model_tensors,
    receive_in_threads,
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology, receivers, checksum", [
    ("broadcast", 2, "wsum64"),
    ("chain", 2, "crc32"),
    ("auto", 1, "sha256"),
])
def test_every_receiver_gets_exactly_the_senders_tensors(topology, receivers, checksum):
    members = ["trainer"] + [f"r{i}" for i in range(1, receivers + 1)]
    plan = SenderPlan(members=members, topology=topology, checksum_algorithm=checksum)
    with SpawnedSender(plan) as sender:
        port, manifest = sender.ready()
        validate_against(manifest, expected_spec(model_tensors()))  # what a replica checks first
        results = receive_in_threads(members, port, manifest, topology=topology)
        assert sender.next()[0] == "sent"
    assert manifest.checksum_algorithm == checksum
    for member in members[1:]:
        assert_same_tensors(results[member], model_tensors())


@pytest.mark.timeout(120)
def test_a_corrupted_bucket_fails_the_checksum_on_every_receiver():
    members = ["trainer", "r1", "r2"]
    with SpawnedSender(SenderPlan(members=members, corrupt_bucket=1)) as sender:
        port, manifest = sender.ready()
        results = receive_in_threads(members, port, manifest)
        assert sender.next()[0] == "sent"  # the sender cannot tell
    for member in members[1:]:
        assert isinstance(results[member], ChecksumMismatch), results[member]
        assert results[member].expected == manifest.checksum


@pytest.mark.timeout(60)
def test_a_manifest_that_does_not_match_the_expected_spec_is_refused_before_any_transfer():
    tensors = model_tensors()
    manifest = build_manifest(tensors[:-1], BUCKET)  # lacks "tail.empty"
    with pytest.raises(ManifestMismatch, match="tail.empty"):
        validate_against(manifest, expected_spec(tensors))


@pytest.mark.timeout(120)
def test_a_sender_whose_tensors_differ_from_the_manifest_fails_fast_everywhere():
    members = ["trainer", "r1", "r2"]
    plan = SenderPlan(members=members, config_overrides={"op_timeout_s": 60.0})
    plan.wrong_tensor = True
    with SpawnedSender(plan) as sender:
        port, manifest = sender.ready()
        started = time.monotonic()
        results = receive_in_threads(members, port, manifest, op_timeout_s=60.0)
        elapsed = time.monotonic() - started
        kind, error, message = sender.next()
    assert (kind, error) == ("send_error", "ManifestMismatch") and "layers.0.mask" in message
    for member in members[1:]:
        assert isinstance(results[member], PeerLost), results[member]
    assert elapsed < 30  # the sender closing its group ends the receivers' waits, not their timeout


@pytest.mark.timeout(120)
def test_a_sender_that_dies_mid_sync_ends_the_receivers_with_a_clear_error():
    members = ["trainer", "r1", "r2"]
    with SpawnedSender(SenderPlan(members=members, exit_after_group=True)) as sender:
        port, manifest = sender.ready()
        started = time.monotonic()
        results = receive_in_threads(members, port, manifest, setup_timeout_s=10.0, op_timeout_s=15.0)
        elapsed = time.monotonic() - started
    for member in members[1:]:
        # Depending on how far the receivers got when it died: lost mid-transfer (PeerLost, at once),
        # group creation cut short (bounded by the setup timeout), or - rarely - gloo not seeing the
        # dead peer's sockets close, when the operation timeout ends the wait (TransferTimeout).
        assert isinstance(results[member], PeerLost | TransferTimeout), results[member]
    assert elapsed < 25   # every outcome is a clear error within the setup / operation timeouts


@pytest.mark.timeout(60)
async def test_async_wrappers_run_the_transfer_off_the_event_loop():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    members = ["trainer", "r1"]
    with InProcessMesh(members) as mesh:
        # Group creation blocks until both members arrive, so it runs in threads too.
        sender_group, receiver_group = await asyncio.gather(
            asyncio.to_thread(mesh.caches["trainer"].get, "g", members, (HOST, mesh.port)),
            asyncio.to_thread(mesh.caches["r1"].get, "g", members, (HOST, mesh.port)))
        sent, received = await asyncio.gather(send_weights_async(sender_group, manifest, tensors),
                                               receive_weights_async(receiver_group, manifest))
    assert sent.bytes == manifest.total_bytes and sent.buckets == manifest.num_buckets
    assert_same_tensors(received, tensors)


@pytest.mark.timeout(60)
def test_a_busy_group_refuses_and_a_cancelled_transfer_closes_its_group():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    members = ["trainer", "r1"]
    with InProcessMesh(members) as mesh:
        groups = {}
        threads = [threading.Thread(target=lambda m=m: groups.__setitem__(
            m, mesh.caches[m].get("g", members, (HOST, mesh.port)))) for m in members]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        with groups["r1"].claim():  # as if another transfer were running on it
            with pytest.raises(GroupBusy):
                receive_weights(groups["r1"], manifest)
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(TransferCancelled):
            receive_weights(groups["r1"], manifest, cancel=cancel)
        assert groups["r1"].closed
        with pytest.raises(PeerLost):  # the receiver's closed connection ends the sender at once
            send_weights(groups["trainer"], manifest, tensors)


@pytest.mark.timeout(60)
def test_receiving_into_a_reused_staging_buffer():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    members = ["trainer", "r1"]
    staging = torch.full((manifest.total_bytes + 100,), 0xAB, dtype=torch.uint8)
    with InProcessMesh(members) as mesh:
        group = {}
        thread = threading.Thread(target=lambda: group.setdefault(
            "r1", mesh.caches["r1"].get("g", members, (HOST, mesh.port))))
        thread.start()
        sender = mesh.caches["trainer"].get("g", members, (HOST, mesh.port))
        thread.join(timeout=30)
        for _ in range(2):
            done = threading.Thread(target=send_weights, args=(sender, manifest, tensors))
            done.start()
            received = receive_weights(group["r1"], manifest, out=staging)
            done.join(timeout=30)
            assert_same_tensors(received, tensors)
            assert received["layers.0.big"].data_ptr() - staging.data_ptr() < manifest.total_bytes
        with pytest.raises(ValueError, match="at least"):
            receive_weights(group["r1"], manifest, out=staging[:10])


def _nccl_member(rank: int, port: int, results: mp.Queue) -> None:
    try:
        torch.cuda.set_device(rank)
        members = ["trainer", "r1"]
        tensors = [(n, t.cuda()) for n, t in model_tensors()]
        manifest = build_manifest(tensors, BUCKET)
        with GroupCache(members[rank]) as cache:
            if rank == 0:
                cache.host_rendezvous(HOST, port)
            group = cache.get("g", members, (HOST, port), backend="nccl")
            if rank == 0:
                send_weights(group, manifest, tensors)
                results.put((rank, "ok"))
            else:
                received = receive_weights(group, manifest)
                same = all(torch.equal(received[n], t) for n, t in tensors)
                results.put((rank, "ok" if same else "different"))
    except Exception:
        results.put((rank, traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_nccl_transfer_between_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL refuses two ranks on one GPU)")
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_member, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    outcome = dict(results.get(timeout=150) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert outcome == {0: "ok", 1: "ok"}, outcome


@pytest.mark.timeout(60)
def test_a_manifest_without_bytes_transfers_nothing_and_still_checks_out():
    tensors = [("empty.a", torch.empty(0, 3)), ("empty.b", torch.empty(0, dtype=torch.bfloat16))]
    manifest = build_manifest(tensors, BUCKET)
    assert manifest.total_bytes == 0 and manifest.num_buckets == 0
    members = ["trainer", "r1"]
    with InProcessMesh(members) as mesh:
        results = mesh.sync(members, tensors, manifest)
    assert results["trainer"].buckets == 0
    assert_same_tensors(results["r1"], tensors)
