"""Unit tests of the manifest: layout, dict round trip, validation, checksums."""

from __future__ import annotations

import json
import math

import pytest
import torch

from weight_transfer import (
    ALIGNMENT,
    CHECKSUM_ALGORITHMS,
    InvalidManifest,
    Manifest,
    ManifestMismatch,
    build_manifest,
    validate_against,
)
from weight_transfer.manifest import StreamHasher, views_of

from .helpers import BUCKET, expected_spec, model_tensors

pytestmark = pytest.mark.timeout(30)


def stream_of(tensors, manifest: Manifest) -> torch.Tensor:
    """The byte stream the manifest describes, assembled by hand."""
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    for entry, (_, tensor) in zip(manifest.tensors, tensors):
        start = manifest.stream_offset(entry)
        flat[start:start + entry.nbytes] = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat


def test_layout_packs_in_order_aligned_and_splits_big_tensors():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    cursor = 0
    for entry, (name, tensor) in zip(manifest.tensors, tensors):
        assert entry.name == name
        assert entry.nbytes == tensor.numel() * tensor.element_size()
        start = manifest.stream_offset(entry)
        assert entry.offset_bytes < BUCKET
        if entry.nbytes:
            assert start % ALIGNMENT == 0 and cursor <= start < cursor + ALIGNMENT
            cursor = start + entry.nbytes
    assert manifest.total_bytes == cursor
    assert manifest.num_buckets == math.ceil(cursor / BUCKET)
    big = next(e for e in manifest.tensors if e.name == "layers.0.big")
    assert big.nbytes > 2 * BUCKET  # spans buckets rather than getting its own
    assert [manifest.bucket_range(k)[1] - manifest.bucket_range(k)[0]
            for k in range(manifest.num_buckets - 1)] == [BUCKET] * (manifest.num_buckets - 1)


def test_entries_describe_dtype_and_shape():
    manifest = build_manifest(model_tensors(), BUCKET)
    by_name = {e.name: e for e in manifest.tensors}
    assert by_name["embed.weight"].dtype == "bfloat16" and by_name["embed.weight"].shape == (37, 29)
    assert by_name["layers.0.empty"].nbytes == 0 and by_name["layers.0.empty"].shape == (0, 7)
    assert by_name["layers.0.step"].shape == () and by_name["layers.0.step"].nbytes == 8
    assert by_name["layers.0.proj_t"].shape == (40, 24)


def test_views_of_the_stream_give_back_every_tensor():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    views = views_of(manifest, stream_of(tensors, manifest))
    for name, tensor in tensors:
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
        assert torch.equal(views[name], tensor)


def test_dict_round_trip_is_plain_json():
    manifest = build_manifest(model_tensors(), BUCKET)
    data = json.loads(json.dumps(manifest.to_dict()))
    assert Manifest.from_dict(data) == manifest


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: d["tensors"][0].update(nbytes=3), "nbytes"),
    (lambda d: d["tensors"][1].update(dtype="float99"), "unknown dtype"),
    (lambda d: d["tensors"][1].update(name=d["tensors"][0]["name"]), "repeated"),
    (lambda d: d.update(total_bytes=10), "total_bytes"),
    (lambda d: d.update(checksum_algorithm="md5"), "checksum_algorithm"),
    (lambda d: d.update(checksum="not hex"), "hex"),
    (lambda d: d.pop("bucket_size_bytes"), "malformed"),
    (lambda d: d["tensors"][3].update(offset_bytes=d["tensors"][3]["offset_bytes"] + 2), "misaligned"),
])
def test_from_dict_rejects_inconsistent_manifests(corrupt, message):
    data = build_manifest(model_tensors(), BUCKET).to_dict()
    corrupt(data)
    with pytest.raises(InvalidManifest, match=message):
        Manifest.from_dict(data)


def test_build_rejects_repeated_names_and_bad_bucket_size():
    with pytest.raises(InvalidManifest, match="repeated"):
        build_manifest([("a", torch.zeros(2)), ("a", torch.zeros(2))], BUCKET)
    with pytest.raises(InvalidManifest, match="positive"):
        build_manifest([("a", torch.zeros(2))], 0)


def test_validate_against_accepts_the_same_tensors_in_any_order():
    tensors = model_tensors()
    manifest = build_manifest(tensors, BUCKET)
    validate_against(manifest, list(reversed(expected_spec(tensors))))
    validate_against(manifest, [(n, t.dtype, list(t.shape)) for n, t in tensors])  # torch dtypes, lists


@pytest.mark.parametrize("edit, bad_name, message", [
    (lambda spec: spec.pop(2), "layers.0.empty", "not expected"),
    (lambda spec: spec.append(("extra.weight", "float32", (2,))), "extra.weight", "missing"),
    (lambda spec: spec.__setitem__(0, ("embed.weight", "float32", (37, 29))), "embed.weight", "bfloat16"),
    (lambda spec: spec.__setitem__(1, ("layers.0.norm", "float32", (14,))), "layers.0.norm", "shape"),
])
def test_validate_against_names_the_first_bad_tensor(edit, bad_name, message):
    manifest = build_manifest(model_tensors(), BUCKET)
    spec = expected_spec(model_tensors())
    edit(spec)
    with pytest.raises(ManifestMismatch, match=message) as caught:
        validate_against(manifest, spec)
    assert caught.value.tensor_name == bad_name
    assert bad_name in str(caught.value)


def reference_wsum64(data: bytes) -> str:
    """The wsum64 definition, word by word in Python integers."""
    data = data + bytes(-len(data) % 512)
    s1 = s2 = 0
    for row in range(len(data) // 512):
        row_sum = sum(int.from_bytes(data[row * 512 + 8 * k: row * 512 + 8 * k + 8], "little")
                      for k in range(64))
        s1 += row_sum
        s2 += (2 * row + 1) * row_sum
    mask = (1 << 64) - 1
    return f"{s1 & mask:016x}{s2 & mask:016x}"


def random_bytes(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def digest(algorithm: str, data: torch.Tensor, pieces: list[int] | None = None) -> str:
    hasher = StreamHasher(algorithm)
    start = 0
    for size in pieces or [data.numel()]:
        hasher.update(data[start:start + size])
        start += size
    hasher.update(data[start:])
    return hasher.hexdigest()


def test_wsum64_matches_its_definition_however_the_stream_is_cut():
    data = random_bytes(5000)
    expected = reference_wsum64(bytes(data.numpy()))
    assert digest("wsum64", data) == expected
    assert digest("wsum64", data, [1, 511, 3, 700, 1024]) == expected  # odd and misaligned pieces
    assert digest("wsum64", data, [0, 4096]) == expected


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_every_single_corrupted_byte_is_detected(algorithm):
    data = random_bytes(1100)
    clean = digest(algorithm, data)
    for position in range(data.numel()):
        corrupted = data.clone()
        corrupted[position] ^= 1 << (position % 8)
        assert digest(algorithm, corrupted) != clean, position


@pytest.mark.parametrize("algorithm", CHECKSUM_ALGORITHMS)
def test_swapped_or_duplicated_rows_are_detected(algorithm):
    data = random_bytes(8 * 512)
    clean = digest(algorithm, data)
    swapped = data.clone()
    swapped[512:1024], swapped[3072:3584] = data[3072:3584], data[512:1024]
    duplicated = data.clone()
    duplicated[1024:1536] = data[0:512]
    assert digest(algorithm, swapped) != clean
    assert digest(algorithm, duplicated) != clean


def test_manifest_checksum_covers_the_stream_with_its_padding():
    tensors = model_tensors()
    for algorithm in CHECKSUM_ALGORITHMS:
        manifest = build_manifest(tensors, BUCKET, checksum_algorithm=algorithm)
        assert manifest.checksum == digest(algorithm, stream_of(tensors, manifest))


def test_from_dict_rejects_overlapping_tensors():
    data = build_manifest(model_tensors(), BUCKET).to_dict()
    data["tensors"][1].update(bucket_index=0, offset_bytes=0)
    with pytest.raises(InvalidManifest, match="overlap"):
        Manifest.from_dict(data)
