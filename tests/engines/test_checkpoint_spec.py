"""Reading a checkpoint's weight spec from safetensors headers (used by the vLLM backend)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from replica_agent.engines import WeightSpec
from replica_agent.engines.checkpoint_spec import (
    CheckpointError,
    checkpoint_files,
    checkpoint_spec,
    read_tensor,
)
from replica_agent.engines.vllm_config import VllmEngineConfig
from replica_agent.engines.vllm_engine import VllmEngine

pytestmark = pytest.mark.timeout(60)


def test_spec_of_a_sharded_checkpoint(tmp_path):
    save_file({"b.weight": torch.zeros(2, 3), "a.rotary_emb.inv_freq": torch.zeros(4)}, tmp_path / "part-1.safetensors")
    save_file({"a.weight": torch.zeros(5, dtype=torch.bfloat16), "steps": torch.zeros(1, dtype=torch.int64)},
              tmp_path / "part-2.safetensors")
    save_file({"stale.weight": torch.zeros(1)}, tmp_path / "consolidated.safetensors")  # not in the index
    weight_map = {"b.weight": "part-1.safetensors", "a.weight": "part-2.safetensors", "steps": "part-2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    spec, files = checkpoint_spec(tmp_path)
    assert spec == [WeightSpec("a.weight", "bfloat16", (5,)), WeightSpec("b.weight", "float32", (2, 3)),
                    WeightSpec("steps", "int64", (1,))]
    assert files["a.weight"].name == "part-2.safetensors"
    served, _ = checkpoint_spec(tmp_path, "float16")
    assert [s.dtype for s in served] == ["float16", "float16", "int64"]  # only floating point is recast
    tensor = read_tensor(files["b.weight"], "b.weight", "float16")
    assert tensor.dtype is torch.float16 and tensor.shape == (2, 3)


def test_unreadable_checkpoints_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="too short"):
        checkpoint_spec(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((4).to_bytes(8, "little") + b"{no}")
    with pytest.raises(CheckpointError, match="malformed"):
        checkpoint_spec(tmp_path)


async def test_vllm_engine_checks_the_checkpoint_before_starting_vllm(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    created = []
    engine = VllmEngine(VllmEngineConfig(model_path=str(tmp_path)), api=_never_called(created))
    with pytest.raises(CheckpointError):
        await engine.start()
    assert created == []


def _never_called(created):
    from replica_agent.engines.vllm_config import VllmApi

    return VllmApi(lambda kwargs: created.append(kwargs), sampling_params=dict, delta_output_kind=None)
