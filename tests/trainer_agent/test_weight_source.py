"""WeightSource: the replica engines' naming, versions that only grow, snapshots that stay frozen."""

from __future__ import annotations

import pytest
import torch

from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from modeling.presets import build_preset_model, save_preset
from replica_agent.engines.torch_weights import ModelWeights
from trainer_agent.weight_source import TorchWeightSource, WeightSource

pytestmark = pytest.mark.timeout(120)


def loaded(model: str = "tiny-llama", **kwargs) -> TorchWeightSource:
    source = TorchWeightSource(model, **kwargs)
    source.load()
    return source


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_names_match_the_replica_engine_spec_with_tied_weights_once(preset):
    source = loaded(preset, seed=3)
    engine_spec = ModelWeights(build_preset_model(preset, 3), torch.device("cpu")).spec
    assert source.weight_spec() == engine_spec
    names = [name for name, _ in source.named_weights()]
    assert len(names) == len(set(names))
    assert ("lm_head.weight" in names) == (preset == "tiny-llama")  # tiny-qwen2 ties it to the embeddings


def test_a_preset_and_seed_give_the_replicas_weights_and_a_directory_loads_the_same(tmp_path):
    reference = dict(build_preset_model("tiny-llama", 5).named_parameters())
    from_preset = loaded(seed=5)
    from_directory = loaded(str(save_preset("tiny-llama", 5, tmp_path / "model")))
    for source in (from_preset, from_directory):
        for name, tensor in source.named_weights():
            assert torch.equal(tensor, reference[name]), name


def test_bfloat16_weights_are_held_and_described_as_bfloat16():
    source = loaded(dtype="bfloat16")
    assert {spec.dtype for spec in source.weight_spec()} == {"bfloat16"}


def test_set_weights_publishes_a_newer_version_and_leaves_snapshots_alone():
    source = loaded(weight_version=3)
    before = source.snapshot()
    assert before.weight_version == 3 and source.snapshot(3).weight_version == 3
    name, tensor = next(iter(source.named_weights()))
    source.set_weights({name: torch.zeros_like(tensor)}, weight_version=4)
    assert source.weight_version == 4
    assert torch.count_nonzero(dict(source.named_weights())[name]) == 0
    assert torch.count_nonzero(dict(before.tensors)[name]) > 0  # the snapshot did not follow
    with pytest.raises(FailedPrecondition, match="only the current version"):
        source.snapshot(3)


def test_a_tied_alias_updates_the_shared_tensor():
    source = loaded("tiny-qwen2")
    shape = dict(source.named_weights())["model.embed_tokens.weight"].shape
    source.set_weights({"lm_head.weight": torch.ones(shape)}, weight_version=1)
    assert torch.all(dict(source.named_weights())["model.embed_tokens.weight"] == 1)


def test_bad_updates_change_nothing():
    source = loaded(weight_version=2)
    name, tensor = next(iter(source.named_weights()))
    original = tensor.clone()
    with pytest.raises(InvalidArgument, match="unknown weight 'nope'"):
        source.set_weights({"nope": torch.zeros(1)}, weight_version=3)
    with pytest.raises(InvalidArgument, match=name):
        source.set_weights({name: torch.zeros(1, 2)}, weight_version=3)
    with pytest.raises(FailedPrecondition, match="versions only grow"):
        source.set_weights({name: torch.zeros_like(tensor)}, weight_version=2)
    with pytest.raises(RuntimeError), source.updating(5):
        raise RuntimeError("optimizer step failed")
    assert source.weight_version == 2
    assert torch.equal(dict(source.named_weights())[name], original)


def test_nothing_is_readable_before_load():
    source = TorchWeightSource("tiny-llama")
    with pytest.raises(FailedPrecondition, match="not loaded"):
        source.weight_spec()
    with pytest.raises(FailedPrecondition, match="not loaded"):
        source.snapshot()


class _PluginWithoutInit(WeightSource):   # a user's WeightSource that keeps the base __init__
    def _load(self):
        self._tensors = {"w": torch.zeros(2)}

    def _named_tensors(self):
        yield from self._tensors.items()

    def _write(self, named_tensors):
        self._tensors.update(named_tensors)


def test_a_plugin_that_keeps_the_base_init_is_built_with_the_agents_seed_and_dtype(monkeypatch):
    import sys
    import types

    from trainer_agent.config import TrainerAgentConfig
    from trainer_agent.node import create_weight_source

    module = types.ModuleType("user_weights")
    module.Plugin = _PluginWithoutInit
    monkeypatch.setitem(sys.modules, "user_weights", module)
    config = TrainerAgentConfig(weight_source="user_weights:Plugin", model_seed=7, weight_dtype="bfloat16",
                                initial_weight_version=2)
    source = create_weight_source(config)
    assert isinstance(source, _PluginWithoutInit)
    assert (source.seed, source.dtype_name, source.weight_version, source.module) == (7, "bfloat16", 2, None)
