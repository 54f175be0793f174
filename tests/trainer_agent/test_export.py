"""The trained model comes out as a Hugging Face directory: transformers loads it, and the replica agent's
engine serving it produces the trainer's own greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from replica_agent.engines import EngineRequest, SamplingParams, create_engine
from trainer_agent.training.export import export_model
from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer, Sample
from trainer_agent.weight_source import TorchWeightSource

pytestmark = pytest.mark.timeout(120)


def greedy_tokens(model: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """``count`` greedily decoded tokens of a transformers causal LM (the trainer's view of its policy)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            token = int(torch.argmax(model(input_ids=ids).logits[0, -1]))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def trained(preset: str) -> TorchWeightSource:
    source = TorchWeightSource(preset)
    source.load()
    trainer = GrpoTrainer.from_weight_source(source, GrpoConfig(lr=5e-2))
    group = [Sample([5, 6, 7], [8 + i, 9], [-1.0, -1.0], reward=float(i)) for i in range(4)]
    trainer.step([group])
    return source


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
async def test_the_exported_model_loads_and_serves_the_trainers_greedy_output(tmp_path, preset):
    source = trained(preset)
    assert source.weight_version == 1
    directory = export_model(source, tmp_path / "model")
    assert {p.name for p in directory.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                      "rollmesh.json"}
    assert json.loads((directory / "rollmesh.json").read_text())["weight_version"] == 1
    loaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    live = dict(source.named_weights())
    for name, param in loaded.named_parameters():
        assert torch.equal(param.detach(), live[source._canonical_name(name)]), name
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert tokenizer.eos_token_id == 1 and tokenizer.chat_template

    prompt = [3, 14, 15, 9, 2]
    expected = greedy_tokens(source.module.eval(), prompt, 12)
    engine = create_engine("torch", model_path=str(directory), device="cpu", stream_interval=4)
    await engine.start()
    try:
        chunks = [c async for c in engine.generate(EngineRequest("g", prompt, SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True)))]
    finally:
        await engine.close()
    assert [t for c in chunks for t in c.token_ids] == expected


def test_a_second_export_replaces_the_first_whole(tmp_path):
    source = trained("tiny-llama")
    export_model(source, tmp_path / "model")
    (tmp_path / "model" / "stale.txt").write_text("from an older run")
    export_model(source, tmp_path / "model")
    assert not (tmp_path / "model" / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]   # no staging directory left behind
