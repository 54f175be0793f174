"""The vLLM backend driving real vLLM on a GPU.

Skipped unless CUDA is available and ``vllm`` is importable, which rules out
the CPU development machines (vllm pins a CUDA build of torch) and, so far,
the lent GPU machine too (it cannot install packages). Run it by hand on a
GPU host with vllm: ``pytest -m gpu tests/engines/test_vllm_gpu.py``.

The model is a tiny random Llama written to a temporary directory, so
nothing is downloaded; the tokenizer is skipped (the engine sends token ids
and asks for no detokenisation).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from replica_agent.engines import (
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    SamplingParams,
    TokenSegment,
    create_engine,
)


def _gpu_and_vllm() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not _gpu_and_vllm(), reason="needs a CUDA GPU and vllm installed"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def greedy(rid: str, max_tokens: int = 8, prefix: list[int] | None = None) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    request = EngineRequest(rid, [1, 5, 7, 9], sampling)
    if prefix:
        request.resume_segments = [TokenSegment(list(prefix), [0.0] * len(prefix))]
    return request


async def run(engine, request):
    return [chunk async for chunk in engine.generate(request)]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def test_real_vllm_generation_sleep_and_weight_update(tiny_llama):
    engine = create_engine(
        "vllm", model_path=str(tiny_llama), dtype="bfloat16", memory_fraction=0.3, max_model_len=256,
        enforce_eager=True, stream_interval=4, engine_args={"skip_tokenizer_init": True},
    )
    await engine.start()
    try:
        chunks = await run(engine, greedy("a"))
        first = tokens(chunks)
        assert len(first) == 8 and chunks[-1].finish_reason is FinishReason.LENGTH
        assert len([lp for c in chunks for lp in c.logprobs]) == 8
        assert all(lp <= 0 for c in chunks for lp in c.logprobs)
        assert tokens(await run(engine, greedy("b"))) == first  # greedy is deterministic

        resumed = await run(engine, greedy("c", prefix=first[:3]))
        assert tokens(resumed) == first[3:] and resumed[-1].usage.completion_tokens == 8

        assert await engine.sleep(1) > 0
        await engine.wake_up()
        assert tokens(await run(engine, greedy("d"))) == first  # level 1 restores the weights

        spec = engine.weight_spec()
        await engine.sleep(2)
        assert await engine.is_sleeping()
        await engine.wake_up({"weights"})
        zeros = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in spec}
        await engine.load_weights(zeros, version=1)
        await engine.wake_up({"kv_cache"})
        assert engine.state is EngineState.ACTIVE and not await engine.is_sleeping()
        zeroed = await run(engine, greedy("e"))
        assert tokens(zeroed) == [0] * 8  # all-zero weights give all-zero logits: argmax 0
        assert {s.weight_version for s in zeroed[-1].segments} == {1}

        await engine.sleep(2)
        await engine.wake_up()
        assert engine.state is EngineState.AWAITING_WEIGHTS
        with pytest.raises(EngineUnavailable):
            await anext(engine.generate(greedy("f")))
    finally:
        await engine.close()
