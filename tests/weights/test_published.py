"""Versions a trainer publishes for the trainer agent's DirectoryWeightSource: written atomically, and the old
ones deleted once the agent holds a newer one; and the weights a trainer hands over in its own process
(HandedWeightSource)."""

from __future__ import annotations

import pytest
import torch

from trainer_agent.published_weights import DirectoryWeightSource
from weight_transfer.published import prune, publish


def test_prune_deletes_only_older_versions_and_leaves_other_files(tmp_path):
    for version in (1, 2, 3):
        publish(tmp_path, {"w": torch.full((4,), float(version))}, version)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "x.safetensors").write_bytes(b"")
    assert prune(tmp_path, below=3) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.safetensors", "notes.txt", "x.safetensors"]
    assert prune(tmp_path, below=3) == []


def test_the_agent_still_serves_the_newest_version_after_a_prune(tmp_path):
    source = DirectoryWeightSource("tiny-llama", directory=str(tmp_path))
    source.load()
    name, tensor = next(iter(source.named_weights()))
    for version in (1, 2):
        publish(tmp_path, {name: tensor + version}, version)
    assert source.snapshot(2).weight_version == 2
    prune(tmp_path, below=2)
    restarted = DirectoryWeightSource("tiny-llama", directory=str(tmp_path))
    restarted.load()
    assert restarted.weight_version == 2
    assert torch.equal(dict(restarted.named_weights())[name], tensor + 2)


def test_a_published_version_is_a_safetensors_file_both_ways(tmp_path):
    from safetensors.torch import load_file, save_file

    from weight_transfer.published import read_published

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16), "empty": torch.zeros(0, 3), "flag": torch.tensor([True])}
    path = publish(tmp_path, tensors, 5)
    for read in (load_file(str(path)), read_published(path)):   # safetensors' reader, and ours
        assert sorted(read) == sorted(tensors)
        assert all(torch.equal(read[n], t) and read[n].dtype == t.dtype for n, t in tensors.items())
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    theirs = read_published(tmp_path / "theirs.safetensors")
    assert all(torch.equal(theirs[n], t) for n, t in tensors.items())


def test_read_tensors_outlive_the_file_and_writing_them_leaves_it_unchanged(tmp_path):
    from weight_transfer.published import read_published

    path = publish(tmp_path, {"w": torch.ones(1000)}, 1)
    read = read_published(path)
    read["w"].add_(1)   # copy-on-write: the file keeps its bytes
    assert torch.equal(read_published(path)["w"], torch.ones(1000))
    path.unlink()
    assert torch.equal(read["w"], torch.full((1000,), 2.0))


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    import pytest

    from weight_transfer.published import read_published

    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_published(tmp_path / "bad.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="shorter than its header"):
        read_published(tmp_path / "short.safetensors")


def test_a_snapshot_shares_the_tensors_of_the_version_read(tmp_path):
    source = DirectoryWeightSource("tiny-llama", directory=str(tmp_path))
    source.load()
    name, tensor = next(iter(source.named_weights()))
    publish(tmp_path, {name: tensor + 1}, 1)
    first, again = source.snapshot(1), source.snapshot(1)
    assert dict(first.tensors)[name].data_ptr() == dict(again.tensors)[name].data_ptr()
    assert torch.equal(dict(first.tensors)[name], tensor + 1)


def test_handed_weights_fix_their_layout_at_the_first_hand_over_and_are_shared_not_copied():
    from mesh_runtime.errors import FailedPrecondition, InvalidArgument
    from trainer_agent.published_weights import HandedWeightSource

    source = HandedWeightSource()
    source.load()   # loads nothing: the trainer has handed nothing over
    with pytest.raises(FailedPrecondition, match="not loaded"):
        source.snapshot()
    with pytest.raises(InvalidArgument, match="no tensor"):
        source.hand_over({}, 1)
    first = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    source.hand_over(first, 1)
    snapshot = source.snapshot(1)
    assert [t.data_ptr() for _, t in snapshot.tensors] == [first["a"].data_ptr(), first["b"].data_ptr()]
    for bad, why in (({"a": torch.ones(3, 2)}, "a: float32 \\[3, 2\\] where the model has float32 \\[2, 3\\]"),
                     ({"b": torch.zeros(4)}, "b: float32"), ({"c": torch.ones(1)}, "unknown weight 'c'")):
        with pytest.raises(InvalidArgument, match=why):
            source.hand_over(bad, 2)
    with pytest.raises(FailedPrecondition, match="not newer"):
        source.hand_over({"a": torch.ones(2, 3)}, 1)
    assert source.weight_version == 1 and source.snapshot().tensors == snapshot.tensors   # nothing changed
    source.hand_over({"a": torch.full((2, 3), 2.0)}, 2)   # a part: the rest stays
    assert source.snapshot(2).tensors[1][1].data_ptr() == first["b"].data_ptr()
    assert torch.equal(snapshot.tensors[0][1], torch.ones(2, 3))   # the version 1 snapshot is untouched
    with pytest.raises(FailedPrecondition, match="holds weight version 2, not 1"):
        source.snapshot(1)
