"""Authenticated broadcasts: the plan's sync key keys the rendezvous and the sender's manifest tag,
and every bucket is checked against its BLAKE3 digest before the weights may be used."""

from __future__ import annotations

import dataclasses
import os

import pytest

from weight_transfer import NotAuthentic, TransferTimeout, build_manifest, receive_weights
from weight_transfer.manifest import manifest_tag

from .helpers import BUCKET, SenderPlan, SpawnedSender, assert_same_tensors, model_tensors, receive_in_threads

pytestmark = pytest.mark.timeout(120)
KEY = os.urandom(32)


def test_the_manifest_carries_a_digest_per_bucket_and_its_tag_depends_on_every_one():
    manifest = build_manifest(model_tensors(), BUCKET)
    assert len(manifest.bucket_digests) == manifest.num_buckets > 1
    tag = manifest_tag(KEY, manifest)
    assert len(tag) == 32 and tag != manifest_tag(os.urandom(32), manifest)
    digests = list(manifest.bucket_digests)
    digests[-1] = "0" * 64
    assert manifest_tag(KEY, dataclasses.replace(manifest, bucket_digests=tuple(digests))) != tag


@pytest.mark.parametrize("topology", ["chain", "broadcast"])
def test_an_authenticated_broadcast_delivers_exactly_the_senders_tensors(topology):
    members = ["trainer", "r1", "r2"]
    with SpawnedSender(SenderPlan(members=members, topology=topology, key=KEY)) as sender:
        port, manifest = sender.ready()
        results = receive_in_threads(members, port, manifest, topology=topology, key=KEY)
        assert sender.next()[0] == "sent"
    for member in members[1:]:
        assert_same_tensors(results[member], model_tensors())


def test_a_tampered_bucket_is_caught_by_its_digest_on_every_receiver():
    members = ["trainer", "r1", "r2"]
    with SpawnedSender(SenderPlan(members=members, corrupt_bucket=1, key=KEY)) as sender:
        port, manifest = sender.ready()
        results = receive_in_threads(members, port, manifest, key=KEY)
        assert sender.next()[0] == "sent"
    for member in members[1:]:
        assert isinstance(results[member], NotAuthentic), results[member]
        assert "bucket 1 " in str(results[member])


def test_a_manifest_other_than_the_senders_fails_the_tag_and_the_group_stays_usable():
    # the receivers' plan names a manifest the sender did not sign (e.g. a forged plan): nothing is used,
    # and because the whole stream still passed, the same group serves the next, genuine transfer
    members = ["trainer", "r1"]
    with SpawnedSender(SenderPlan(members=members, key=KEY, rounds=2)) as sender:
        port, manifest = sender.ready()
        forged = dataclasses.replace(manifest, checksum="0" * len(manifest.checksum))
        first, second = receive_in_threads(members, port, [forged, manifest], key=KEY, rounds=2)["r1"]
        assert isinstance(first, NotAuthentic) and "manifest tag" in str(first)
        assert_same_tensors(second, model_tensors())
        assert sender.next()[0] == sender.next()[0] == "sent"


def test_a_member_without_the_key_cannot_join_the_group():
    members = ["trainer", "r1"]
    with SpawnedSender(SenderPlan(members=members, key=KEY, config_overrides={"setup_timeout_s": 4})) as sender:
        port, manifest = sender.ready()
        outsider = receive_in_threads(members, port, manifest, key=os.urandom(32), setup_timeout_s=4)["r1"]
        assert isinstance(outsider, TransferTimeout), outsider   # its keys sit under a prefix nobody else uses


def test_an_authenticated_receive_refuses_a_manifest_without_digests():
    manifest = dataclasses.replace(build_manifest(model_tensors(), BUCKET), bucket_digests=())
    with pytest.raises(NotAuthentic, match="bucket digests"):
        receive_weights(_NoGroup(), manifest, key=KEY)


class _NoGroup:
    """Enough of a receiving group for the checks made before any transfer."""

    rank = 1
