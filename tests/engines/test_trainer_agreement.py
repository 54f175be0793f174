"""The torch engine and the GRPO trainer compute the same model: the log-probabilities the engine reports for the
tokens it sampled equal the trainer's recomputation of the same tokens with the same weights.

This is what makes the importance ratio of on-policy samples 1. It broke silently once (transformers before 5.24
took the KV cache under another keyword, the engine's was ignored, and every decode step saw one token), so it
runs under every dependency set the project declares (``scripts/test --pins gpu`` runs this file too).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from modeling.presets import build_preset_model
from replica_agent.engines import EngineRequest, SamplingParams
from trainer_agent.training.grpo import Sample, completion_logprobs

pytestmark = [pytest.mark.timeout(120), pytest.mark.pins]


def _prompt(i: int) -> list[int]:
    """Prompts of 3..13 tokens, so batched rows are padded and prefills are grouped differently."""
    return [(i * 41 + j * 13 + 7) % 256 for j in range(3 + i % 11)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_engine_logprobs_equal_the_trainers(torch_engine_factory, collect, preset, temperature):
    engine = await torch_engine_factory(preset=preset, seed=4)
    requests = [EngineRequest(f"r{i}", _prompt(i), SamplingParams(max_tokens=24, temperature=temperature,
                                                                      seed=100 + i, logprobs=True))
                for i in range(12)]
    # a shared prefix: the last four repeat the first prompt and extend it, so the prefix cache serves them
    requests += [EngineRequest(f"p{i}", _prompt(0) + [50 + i] * (i + 1),
                                   SamplingParams(max_tokens=24, temperature=temperature, seed=200 + i,
                                                  logprobs=True)) for i in range(4)]
    outcomes = await asyncio.gather(*(collect(engine, r) for r in requests))
    samples = [Sample(r.prompt_token_ids, o.tokens, o.logprobs) for r, o in zip(requests, outcomes)]
    assert all(len(s.completion_ids) == 24 for s in samples)

    model = build_preset_model(preset, 4).eval()
    with torch.no_grad():
        logprobs, mask = completion_logprobs(model, samples, torch.device("cpu"), temperature)
    rollout = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.rollout_logprobs) for s in samples], batch_first=True)
    diff = (rollout - logprobs).abs()[mask]
    assert float(diff.mean()) <= 1e-5 and float(diff.max()) <= 1e-4, (float(diff.mean()), float(diff.max()))
