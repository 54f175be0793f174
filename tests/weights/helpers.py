"""Shared pieces of the weight-transfer tests, importable by spawned sender processes."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import traceback

import torch

from weight_transfer import (
    GroupCache,
    Manifest,
    WeightTransferConfig,
    build_manifest,
    receive_weights,
    send_weights,
)

HOST = "127.0.0.1"
BUCKET = 4096


def config(**overrides) -> WeightTransferConfig:
    """A loopback config with timeouts short enough for tests but long enough for a busy 2-core box."""
    values = dict(bucket_size_bytes=BUCKET, gloo_interface="lo", setup_timeout_s=30.0, op_timeout_s=30.0)
    values.update(overrides)
    return WeightTransferConfig(**values)


def model_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A small "model" with the awkward cases: bfloat16, odd sizes, a tensor spanning several
    buckets, zero-element and 0-dim tensors, bool and int dtypes, a non-contiguous tensor."""
    gen = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(37, 29, generator=gen).to(torch.bfloat16)),  # 2146 B, odd
        ("layers.0.norm", torch.randn(13, generator=gen)),
        ("layers.0.empty", torch.empty(0, 7)),
        ("layers.0.big", torch.randn(3 * BUCKET // 4 + 5, generator=gen)),  # ~3 buckets
        ("layers.0.step", torch.tensor(7, dtype=torch.int64)),
        ("layers.0.mask", torch.rand(11, generator=gen) > 0.5),
        ("layers.0.proj_t", torch.randn(24, 40, generator=gen).t()),  # not contiguous
        ("lm_head.bias", torch.randn(3, generator=gen).to(torch.bfloat16)),
        ("tail.empty", torch.empty(0)),
    ]


def expected_spec(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]


@dataclasses.dataclass
class SenderPlan:
    """What the spawned sender does; everything it reports goes to the result queue."""

    members: list[str]
    group_id: str = "g"
    topology: str = "auto"
    checksum_algorithm: str = "wsum64"
    corrupt_bucket: int | None = None
    exit_after_group: bool = False
    wrong_tensor: bool = False
    key: bytes = b""
    """The plan's sync key: keys the rendezvous and authenticates the broadcast (empty: neither)."""
    rounds: int = 1
    """Transfers to send on the one group."""
    config_overrides: dict = dataclasses.field(default_factory=dict)


def run_sender(plan: SenderPlan, to_test: mp.Queue, from_test: mp.Queue) -> None:
    """Sender process: host the store, publish the port and the manifest, send once, report."""
    try:
        tensors = model_tensors()
        cfg = config(**plan.config_overrides)
        manifest = build_manifest(tensors, cfg.bucket_size_bytes, checksum_algorithm=plan.checksum_algorithm)
        with GroupCache(plan.members[0], cfg) as cache:
            port = cache.host_rendezvous(HOST)
            to_test.put(("ready", port, manifest.to_dict()))
            hook = None
            if plan.corrupt_bucket is not None:
                def hook(index: int, packed: torch.Tensor) -> None:
                    if index == plan.corrupt_bucket:
                        packed[17] ^= 0x10
            group = cache.get(plan.group_id, plan.members, (HOST, port), "gloo", plan.key)
            if plan.exit_after_group:
                os._exit(3)  # a peer that dies without a word
            sent = tensors
            if plan.wrong_tensor:
                sent = [(n, torch.zeros(1) if n == "layers.0.mask" else t) for n, t in tensors]
            for _ in range(plan.rounds):
                try:
                    result = send_weights(group, manifest, sent, topology=plan.topology, bucket_hook=hook,
                                          key=plan.key)
                    to_test.put(("sent", result.bytes, result.buckets))
                except Exception as err:  # reported to the test
                    to_test.put(("send_error", type(err).__name__, str(err)))
            from_test.get(timeout=60)  # keep the group alive until the test is done with it
    except Exception:
        to_test.put(("crash", traceback.format_exc()))


class SpawnedSender:
    """Start ``run_sender`` in a spawned process; always reaps it."""

    def __init__(self, plan: SenderPlan) -> None:
        ctx = mp.get_context("spawn")
        self.to_test = ctx.Queue()
        self.from_test = ctx.Queue()
        self.process = ctx.Process(target=run_sender, args=(plan, self.to_test, self.from_test), daemon=True)

    def __enter__(self) -> SpawnedSender:
        self.process.start()
        return self

    def next(self, timeout: float = 60.0) -> tuple:
        message = self.to_test.get(timeout=timeout)
        assert message[0] != "crash", message[1]
        return message

    def ready(self) -> tuple[int, Manifest]:
        kind, port, manifest = self.next()
        assert kind == "ready"
        return port, Manifest.from_dict(manifest)

    def __exit__(self, *exc_info) -> None:
        self.from_test.put("done")
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def receive_in_threads(members: list[str], port: int, manifest: Manifest | list[Manifest], *, group_id: str = "g",
                       topology: str = "auto", key: bytes = b"", rounds: int = 1,
                       **config_overrides) -> dict[str, object]:
    """Run every non-sender member's ``receive_weights`` in its own thread (own GroupCache).

    ``key`` is the plan's sync key. With ``rounds`` > 1 each member receives that many transfers on the
    same group (``manifest`` may then be a list, one per round) and the results are lists. Returns {member: dict of tensors, or the exception it raised}.
    """
    results: dict[str, object] = {}

    def receive(member: str) -> None:
        with GroupCache(member, config(**config_overrides)) as cache:
            got: list[object] = []
            for round_manifest in (manifest if isinstance(manifest, list) else [manifest] * rounds):
                try:
                    group = cache.get(group_id, members, (HOST, port), "gloo", key)
                    got.append(receive_weights(group, round_manifest, topology=topology, key=key))
                except Exception as err:
                    got.append(err)
            results[member] = got[0] if rounds == 1 else got

    threads = [threading.Thread(target=receive, args=(m,), daemon=True) for m in members[1:]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


class InProcessMesh:
    """One GroupCache per member, all in this process; members[0] of a sync sends from the caller's
    thread, the others receive in threads. Closes every cache on exit."""

    def __init__(self, member_ids: list[str], **config_overrides) -> None:
        self.caches = {m: GroupCache(m, config(**config_overrides)) for m in member_ids}
        self.port = self.caches[member_ids[0]].host_rendezvous(HOST)

    def __enter__(self) -> InProcessMesh:
        return self

    def __exit__(self, *exc_info) -> None:
        for cache in self.caches.values():
            cache.close()

    def sync(self, members: list[str], tensors, manifest: Manifest, *, group_id: str = "g",
             topology: str = "auto") -> dict[str, object]:
        """Run one transfer; returns {member: tensors dict / SendResult, or the exception raised}."""
        results: dict[str, object] = {}

        def receive(member: str) -> None:
            try:
                group = self.caches[member].get(group_id, members, (HOST, self.port))
                results[member] = receive_weights(group, manifest, topology=topology)
            except Exception as err:
                results[member] = err

        threads = [threading.Thread(target=receive, args=(m,), daemon=True) for m in members[1:]]
        for thread in threads:
            thread.start()
        try:
            group = self.caches[members[0]].get(group_id, members, (HOST, self.port))
            results[members[0]] = send_weights(group, manifest, tensors, topology=topology)
        except Exception as err:
            results[members[0]] = err
        for thread in threads:
            thread.join(timeout=120)
        return results


def assert_same_tensors(received: object, tensors: list[tuple[str, torch.Tensor]]) -> None:
    assert isinstance(received, dict), f"the receiver failed: {received!r}"
    assert list(received) == [name for name, _ in tensors]
    for name, tensor in tensors:
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
