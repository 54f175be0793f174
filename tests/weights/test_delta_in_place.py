"""A delta applied to served tensors in place (weight_transfer.delta_in_place): the target bit for bit, or,
refused, the served tensors exactly as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weight_transfer import InvalidManifest, ManifestMismatch, views_of
from weight_transfer.delta import compose_deltas, encode_delta, pack_stream
from weight_transfer.delta_in_place import apply_delta_in_place, check_tensors
from weight_transfer.errors import ChecksumMismatch, NotAuthentic
from weight_transfer.manifest import build_manifest

from .test_delta import KEY, model, step


def served(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What a replica serves: its own copies, which the delta changes."""
    return [(name, tensor.clone()) for name, tensor in tensors]


def same_bytes(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) for (_, x), (_, y) in zip(a, b))


def encoded(base: list, target: list, bucket: int, **kwargs):
    b, t = build_manifest(base, bucket), build_manifest(target, bucket)
    delta = encode_delta(b, iter(base), t, iter(target), base_version=1, **kwargs)
    assert delta is not None
    # as a receiver has it: views into the received delta stream
    received = views_of(delta.manifest, pack_stream(delta.manifest, iter(delta.tensors)))
    return t, delta, received


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bucket", [1 << 20, 4096, 999])
@pytest.mark.parametrize("lr", [1e-6, 1e-4, 1e-1])
@pytest.mark.parametrize("key", [b"", KEY])
def test_a_delta_in_place_turns_the_served_tensors_into_the_target_bit_for_bit(dtype, bucket, lr, key):
    base = model(0, dtype)   # int8 and bool buffers of odd sizes: padding between tensors, odd buckets
    target = step(base, lr, 1)
    t, delta, received = encoded(base, target, bucket)
    replica = served(base)
    apply_delta_in_place(t, replica, delta.manifest, received, key=key)
    assert same_bytes(replica, target)
    check_tensors(t, replica, key=key)


def test_a_composed_delta_applies_in_place():
    versions = [model(0, torch.bfloat16)]
    for seed, lr in enumerate((1e-6, 1e-1, 1e-5), start=1):
        versions.append(step(versions[-1], lr, seed))
    manifests = [build_manifest(v, 4096) for v in versions]
    deltas = [encode_delta(manifests[i], iter(versions[i]), manifests[i + 1], iter(versions[i + 1]),
                           base_version=i) for i in range(3)]
    composed = compose_deltas(deltas, manifests[3], iter(versions[3]))
    assert composed is not None
    replica = served(versions[0])
    apply_delta_in_place(manifests[3], replica, composed.manifest, dict(composed.tensors), key=KEY)
    assert same_bytes(replica, versions[3])


@pytest.mark.parametrize("key", [b"", KEY])
def test_a_delta_applied_in_place_to_other_weights_is_undone(key):
    base = model(0, torch.bfloat16)
    t, delta, received = encoded(base, step(base, 1e-5, 1), 4096)
    assert delta.stats.sparse_buckets   # the words it does not name stay as the replica had them
    other = step(base, 1e-3, 7)         # what a replica at another version serves
    replica = served(other)
    with pytest.raises(NotAuthentic if key else ChecksumMismatch):
        apply_delta_in_place(t, replica, delta.manifest, received, key=key)
    assert same_bytes(replica, other)


def test_a_corrupted_delta_is_refused_and_undone():
    base = model(0, torch.bfloat16)
    t, delta, received = encoded(base, step(base, 1e-5, 1), 4096)
    received = {name: tensor.clone() for name, tensor in received.items()}
    value = next(name for name in received if name.endswith("/v"))
    received[value][0] ^= 1   # one flipped bit in one new value
    replica = served(base)
    with pytest.raises(ChecksumMismatch):
        apply_delta_in_place(t, replica, delta.manifest, received)
    assert same_bytes(replica, base)


def test_indices_out_of_order_out_of_range_or_into_padding_are_refused_and_undone():
    base = model(0, torch.bfloat16)
    small = served(base)
    small[0][1].view(-1)[[3, 90, 500]] += 1                        # embed: bucket 0, sent as indices
    small[4][1].view(-1)[[0, 7]] += 1                              # proj, in a later bucket
    t, delta, received = encoded(base, small, 1 << 20)
    index = next(name for name in received if name.endswith("/i"))
    words = received[index]
    value = index.replace("/i", "/v")
    cases = {"strictly increasing": (words.flip(0), received[value]),
             "out of range": (torch.cat([words[:-1], torch.tensor([1 << 30], dtype=words.dtype)]), received[value])}
    # a word in the padding after the 13-byte int8 buffer ("codes" ends at an odd stream byte), in its place
    codes = next(e for e in t.tensors if e.name == "codes")
    pad_word = (t.stream_offset(codes) + codes.nbytes + 1) // 2
    order = torch.cat([words, torch.tensor([pad_word], dtype=words.dtype)]).argsort()
    cases["non-zero padding"] = (torch.cat([words, torch.tensor([pad_word], dtype=words.dtype)])[order],
                                 torch.cat([received[value], torch.tensor([257], dtype=torch.int16)])[order])
    for match, (bad, values) in cases.items():
        manifest = _resized(delta.manifest, {index: bad.numel(), value: values.numel()})
        replica = served(base)
        with pytest.raises(InvalidManifest, match=match):
            apply_delta_in_place(t, replica, manifest, dict(received, **{index: bad, value: values}))
        assert same_bytes(replica, base), match


def test_a_whole_bucket_with_non_zero_padding_is_refused_and_undone():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-1, 1)   # dense: every bucket goes whole
    t, delta, received = encoded(base, target, 1 << 20)
    whole = dict(received)
    whole["0/f"] = received["0/f"].clone()
    codes = next(e for e in t.tensors if e.name == "codes")
    whole["0/f"][t.stream_offset(codes) + codes.nbytes] = 1   # the first padding byte after the int8 buffer
    replica = served(base)
    with pytest.raises(InvalidManifest, match="non-zero padding"):
        apply_delta_in_place(t, replica, delta.manifest, whole)
    assert same_bytes(replica, base)


def test_served_tensors_that_are_not_the_targets_change_nothing():
    base = model(0, torch.bfloat16)
    t, delta, received = encoded(base, step(base, 1e-4, 1), 4096)
    missing = served(base)[1:]
    reshaped = [(n, x.reshape(-1) if n == "embed" else x) for n, x in served(base)]
    strided = [(n, x.t().contiguous().t() if n == "proj" else x) for n, x in served(base)]   # same shape, transposed
    for replica, match in ((missing, "not the ones"), (reshaped, "embed"), (strided, "not contiguous")):
        before = [(n, x.clone()) for n, x in replica]
        with pytest.raises(ManifestMismatch, match=match):
            apply_delta_in_place(t, replica, delta.manifest, received)
        assert same_bytes(replica, before)


def _resized(manifest, sizes: dict[str, int]):
    """The delta stream's manifest with entries of other lengths (laid out again)."""
    tensors = [(e.name, torch.zeros(sizes.get(e.name, e.shape[0]) if e.name in sizes else e.shape,
                                    dtype=getattr(torch, e.dtype))) for e in manifest.tensors]
    rebuilt = build_manifest(tensors, manifest.bucket_size_bytes)
    return dataclasses.replace(manifest, tensors=rebuilt.tensors, total_bytes=rebuilt.total_bytes)
