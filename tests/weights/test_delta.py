"""Delta versions (weight_transfer.delta): bit-exact against a full copy, refused when malformed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weight_transfer import InvalidManifest, views_of
from weight_transfer.delta import (apply_delta, check_stream, compose_deltas, delta_entries, encode_delta,
                                   pack_stream, stream_checksum)
from weight_transfer.errors import ChecksumMismatch, NotAuthentic
from weight_transfer.manifest import build_manifest

KEY = b"k" * 32


def model(seed: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Tensors of ``dtype`` of several shapes, and an int8 and a bool buffer (odd byte counts)."""
    gen = torch.Generator().manual_seed(seed)
    return [("embed", (torch.randn(300, 64, generator=gen) * 0.02).to(dtype)),
            ("norm", torch.ones(33).to(dtype)),
            ("codes", torch.randint(-100, 100, (13,), generator=gen, dtype=torch.int8)),
            ("mask", torch.rand(7, generator=gen) > 0.5),
            ("proj", (torch.randn(128, 96, generator=gen) * 0.02).to(dtype))]


def step(tensors: list[tuple[str, torch.Tensor]], lr: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """An update of size ``lr`` on float32 masters, cast back to each tensor's dtype (as a trainer serves it)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tensors:
        if t.is_floating_point():
            master = t.float()
            out.append((name, (master - lr * torch.sign(torch.randn(master.shape, generator=gen))).to(t.dtype)))
        elif t.dtype == torch.bool:
            out.append((name, ~t))
        else:
            changed = t.clone()
            changed[4] += 1
            out.append((name, changed))
    return out


def rebuild(base: list, target: list, bucket: int, **kwargs) -> tuple[torch.Tensor, object]:
    base_manifest, target_manifest = build_manifest(base, bucket), build_manifest(target, bucket)
    delta = encode_delta(base_manifest, iter(base), target_manifest, iter(target), base_version=1, **kwargs)
    assert delta is not None
    flat = pack_stream(target_manifest, iter(base))
    assert stream_checksum(target_manifest, flat) == delta.base_checksum == base_manifest.checksum
    received = views_of(delta.manifest, pack_stream(delta.manifest, iter(delta.tensors)))
    apply_delta(target_manifest, flat, delta.manifest, received)
    return flat, delta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bucket", [1 << 20, 4096, 999])
@pytest.mark.parametrize("lr", [1e-6, 1e-4, 1e-1])
def test_a_delta_rebuilds_the_target_bit_for_bit(dtype, bucket, lr):
    base = model(0, dtype)
    target = step(base, lr, 1)
    flat, delta = rebuild(base, target, bucket)
    target_manifest = build_manifest(target, bucket)
    check_stream(target_manifest, flat)
    check_stream(target_manifest, flat, key=KEY)
    assert torch.equal(flat, pack_stream(target_manifest, iter(target)))   # the full copy, byte for byte
    rebuilt = views_of(target_manifest, flat)
    for name, tensor in target:
        assert rebuilt[name].dtype == tensor.dtype and rebuilt[name].shape == tensor.shape
    stats = delta.stats
    assert stats.full_bytes == target_manifest.total_bytes
    assert stats.sparse_buckets + stats.full_buckets + stats.unchanged_buckets == target_manifest.num_buckets


def test_a_small_update_in_bf16_is_a_small_delta_and_a_dense_one_goes_whole():
    base = [(f"w{i}", (torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) * 0.02)
             .to(torch.bfloat16)) for i in range(4)]
    _, small = rebuild(base, step(base, 1e-6, 2), 1 << 16)
    assert 0 < small.stats.density < 0.1 and small.stats.ratio < 0.2 and small.stats.full_buckets == 0
    _, dense = rebuild(base, step(base, 1e-2, 3), 1 << 16)
    assert dense.stats.density > 0.9 and dense.stats.full_buckets == dense.stats.total_words * 2 // (1 << 16)
    unchanged, same = rebuild(base, base, 1 << 16)
    assert same.stats.changed_words == 0 and same.stats.bytes == 0 and same.manifest.tensors == ()


def test_a_delta_denser_than_max_ratio_is_not_offered_and_layouts_must_match():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-1, 1)
    b, t = build_manifest(base, 4096), build_manifest(target, 4096)
    assert encode_delta(b, iter(base), t, iter(target), base_version=1, max_ratio=0.05) is None
    with pytest.raises(ValueError, match="laid out differently"):
        encode_delta(b, iter(base), build_manifest(target, 2048), iter(target), base_version=1)


def test_a_delta_applied_to_other_weights_fails_the_target_check():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-5, 1)
    b, t = build_manifest(base, 4096), build_manifest(target, 4096)
    delta = encode_delta(b, iter(base), t, iter(target), base_version=1)
    assert delta.stats.sparse_buckets   # so words it does not name stay as the receiver had them
    other = step(base, 1e-3, 7)   # what a replica at another version serves
    flat = pack_stream(t, iter(other))
    assert stream_checksum(t, flat) != delta.base_checksum   # a receiver checks this first
    apply_delta(t, flat, delta.manifest, dict(delta.tensors))
    with pytest.raises(ChecksumMismatch):
        check_stream(t, flat)
    with pytest.raises(NotAuthentic):
        check_stream(t, flat, key=KEY)


def test_a_corrupted_delta_is_refused():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-5, 1)
    b, t = build_manifest(base, 4096), build_manifest(target, 4096)
    delta = encode_delta(b, iter(base), t, iter(target), base_version=1)
    tensors = {name: tensor.clone() for name, tensor in delta.tensors}
    value = next(name for name in tensors if name.endswith("/v"))
    tensors[value][0] ^= 1   # one flipped bit in one new value
    flat = pack_stream(t, iter(base))
    apply_delta(t, flat, delta.manifest, tensors)
    with pytest.raises(ChecksumMismatch):
        check_stream(t, flat)


def test_reordered_or_out_of_range_indices_are_refused():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-4, 1)   # sparse enough for indices somewhere
    b, t = build_manifest(base, 1 << 20), build_manifest(target, 1 << 20)
    delta = encode_delta(b, iter(base), t, iter(target), base_version=1, bucket_ratio=1.0)
    names = [name for name, _ in delta.tensors]
    index = next((n for n in names if n.endswith("/i")), None)
    if index is None:   # a bitmap was cheaper: force indices by encoding a tiny change
        small = [(n, x.clone()) for n, x in base]
        small[0][1].view(-1)[[3, 90, 500]] += 1
        t = build_manifest(small, 1 << 20)
        delta = encode_delta(b, iter(base), t, iter(small), base_version=1)
        index = next(n for n, _ in delta.tensors if n.endswith("/i"))
    tensors = {name: tensor.clone() for name, tensor in delta.tensors}
    tensors[index] = tensors[index].flip(0)   # reordered
    with pytest.raises(InvalidManifest, match="strictly increasing"):
        apply_delta(t, pack_stream(t, iter(base)), delta.manifest, tensors)
    tensors[index] = tensors[index].flip(0)
    tensors[index][-1] = 1 << 30   # beyond the bucket
    with pytest.raises(InvalidManifest, match="out of range"):
        apply_delta(t, pack_stream(t, iter(base)), delta.manifest, tensors)


def test_malformed_delta_streams_are_refused_by_name_order_and_shape():
    base = model(0, torch.bfloat16)
    target = step(base, 1e-1, 1)
    b, t = build_manifest(base, 4096), build_manifest(target, 4096)
    delta = encode_delta(b, iter(base), t, iter(target), base_version=1)
    entries = list(delta.manifest.tensors)
    assert [kind for _, kind in delta_entries(delta.manifest, t)] == ["f"] * len(entries)

    def with_entries(new_entries) -> object:
        return dataclasses.replace(delta.manifest, tensors=tuple(new_entries))

    with pytest.raises(InvalidManifest, match="out of order"):
        delta_entries(with_entries([entries[1], entries[0], *entries[2:]]), t)
    with pytest.raises(InvalidManifest, match="names bucket"):
        delta_entries(with_entries([dataclasses.replace(entries[0], name=f"{t.num_buckets}/f")]), t)
    with pytest.raises(InvalidManifest, match="is not BUCKET"):
        delta_entries(with_entries([dataclasses.replace(entries[0], name="0/x")]), t)
    with pytest.raises(InvalidManifest, match="must be uint8"):
        delta_entries(with_entries([dataclasses.replace(entries[0], shape=(5,))]), t)
    lone_values = dataclasses.replace(entries[0], name="0/v", dtype="int16", shape=(3,))
    with pytest.raises(InvalidManifest, match="no indices before it"):
        delta_entries(with_entries([lone_values]), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bucket", [1 << 20, 999])
@pytest.mark.parametrize("lrs", [(1e-6, 1e-6, 1e-6), (1e-6, 1e-1, 1e-6)])
def test_composed_deltas_take_a_replica_several_versions_behind_to_the_target_bit_for_bit(dtype, bucket, lrs):
    """Versions 1..4; the deltas 1->2, 2->3, 3->4 composed rebuild version 4 from version 1 exactly (a dense
    step in between sends some buckets whole), and so do 2->3, 3->4 from version 2."""
    versions = [model(0, dtype)]
    for seed, lr in enumerate(lrs):
        versions.append(step(versions[-1], lr, seed + 10))
    manifests = [build_manifest(v, bucket) for v in versions]
    deltas = [encode_delta(manifests[i], iter(versions[i]), manifests[i + 1], iter(versions[i + 1]),
                           base_version=i + 1) for i in range(3)]
    assert all(d is not None for d in deltas)
    target = manifests[3]
    for first in (0, 1):
        composed = compose_deltas(deltas[first:], target, iter(versions[3]))   # type: ignore[arg-type]
        assert composed is not None
        assert composed.base_version == first + 1 and composed.base_checksum == manifests[first].checksum
        flat = pack_stream(target, iter(versions[first]))
        received = views_of(composed.manifest, pack_stream(composed.manifest, iter(composed.tensors)))
        apply_delta(target, flat, composed.manifest, received)
        check_stream(target, flat)
        assert torch.equal(flat, pack_stream(target, iter(versions[3])))
        single = sum(d.stats.changed_words for d in deltas[first:])   # type: ignore[union-attr]
        assert composed.stats.changed_words <= single or composed.stats.full_buckets
    too_dense = compose_deltas(deltas, target, iter(versions[3]), max_ratio=1e-6)   # type: ignore[arg-type]
    assert too_dense is None
    with pytest.raises(ValueError, match="at least one delta"):
        compose_deltas([], target, iter(versions[3]))
