"""The megatron training backend: the HF <-> megatron mapping and tensor-parallel shards (plain torch), and
megatron-core's real GPT built, loaded, sharded over two gloo ranks and exported by HF names on CPU.

megatron-core's forward pass needs CUDA, so training with this backend is proved by scripts/gpu-check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesh_runtime.config import ConfigError
from modeling.presets import build_preset_model, preset_config
from trainer_agent.config import TrainerAgentConfig
from tests.processes import free_port
from trainer_agent.megatron import mapping

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def checkpoint(preset: str):
    return (mapping.GptLayout.from_hf_config(preset_config(preset).to_dict()),
            {n: p.detach() for n, p in build_preset_model(preset, 0).state_dict().items()})


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_hf_to_megatron_and_back_is_exact(preset):
    layout, hf = checkpoint(preset)
    mg = mapping.to_megatron(layout, hf)
    back = mapping.to_hf(layout, mg)
    expected = {n: t for n, t in hf.items() if not (layout.tied_embeddings and n == "lm_head.weight")}
    assert list(back) == [n for n in mapping.hf_names(layout)] and set(back) == set(expected)
    assert all(torch.equal(back[n], expected[n]) for n in expected)
    assert ("output_layer.weight" in mg) is not layout.tied_embeddings
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mg) is layout.qkv_bias


def test_the_fused_qkv_holds_each_query_group_with_its_key_and_value_head():
    layout, hf = checkpoint("tiny-llama")   # 4 heads, 2 query groups, head_dim 16
    fused = mapping.to_megatron(layout, hf)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    d, per = layout.head_dim, layout.heads_per_group
    group1 = fused[(per + 2) * d:2 * (per + 2) * d]
    assert torch.equal(group1[:per * d], q[per * d:2 * per * d])   # query heads 2 and 3
    assert torch.equal(group1[per * d:(per + 1) * d], k[d:2 * d]) and torch.equal(group1[(per + 1) * d:], v[d:])


@pytest.mark.parametrize("size", [1, 2])
def test_shards_gather_back_to_the_whole_tensor(size):
    layout, hf = checkpoint("tiny-qwen2")
    for name, whole in mapping.to_megatron(layout, hf).items():
        parts = [mapping.shard(name, whole, r, size) for r in range(size)]
        assert torch.equal(mapping.gather(name, parts), whole), name
    fc1 = mapping.to_megatron(layout, hf)["decoder.layers.0.mlp.linear_fc1.weight"]
    rank1 = mapping.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    gate, up = torch.chunk(fc1, 2)
    assert torch.equal(rank1, torch.cat([torch.chunk(gate, 2)[1], torch.chunk(up, 2)[1]]))


def test_layouts_that_do_not_fit_are_refused():
    with pytest.raises(mapping.MappingError, match="Llama-family"):
        mapping.GptLayout.from_hf_config({"model_type": "gpt2", "num_attention_heads": 2, "hidden_size": 8})
    layout, hf = checkpoint("tiny-llama")
    with pytest.raises(mapping.MappingError, match="does not divide"):
        layout.check_tensor_parallel(3)
    with pytest.raises(mapping.MappingError, match="missing"):
        mapping.to_megatron(layout, {k: v for k, v in hf.items() if "down_proj" not in k})
    config = preset_config("tiny-llama").to_dict()
    del config["intermediate_size"]
    with pytest.raises(mapping.MappingError, match="has no intermediate_size"):
        mapping.GptLayout.from_hf_config(config)


@pytest.mark.parametrize("preset, tp", [("tiny-llama", 1), ("tiny-qwen2", 1), ("tiny-llama", 2)])
def test_megatron_core_gpt_loads_shards_and_exports_the_checkpoint(tmp_path, preset, tp):
    pytest.importorskip("megatron.core")
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(tp)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.trainer_agent.megatron_worker", str(outs[r]), preset,
                               str(tp), str(r), str(port)], cwd=ROOT, stderr=subprocess.PIPE) for r in range(tp)]
    for proc in procs:
        _, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err.decode()[-3000:]
    for r, out in enumerate(outs):
        report = json.loads(out.read_text())
        assert report["tp_world"] == tp
        assert report["names"] == [n for n in report["expected_names"] if n in report["names"]]
        assert set(report["names"]) | {"lm_head.weight"} >= set(report["expected_names"])
        assert report["equal"] and report["spec_equal"], f"rank {r}"
        assert report["updated"] and report["untouched"] and report["version"] == 1
        qkv = report["local_shapes"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv == [(4 + 2 * 2) * 16 // tp, 64]   # (heads + 2 kv heads) * head_dim, split over the ranks


def test_megatron_training_needs_cuda_but_a_broadcast_source_does_not(tmp_path):
    pytest.importorskip("megatron.core")
    TrainerAgentConfig(training_backend="megatron").validate()
    config = TrainerAgentConfig(training_backend="megatron")
    config.driver.enabled = True
    with pytest.raises(ConfigError, match="needs CUDA"):
        config.validate()
