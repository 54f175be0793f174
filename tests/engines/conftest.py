"""Fixtures for the engine tests: engine factories that always close what
they start, and a helper that drains a generation stream."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from replica_agent.engines import Engine, GenerationChunk, EngineRequest, create_engine


@dataclasses.dataclass
class Outcome:
    """Everything one generation stream delivered."""

    chunks: list[GenerationChunk]

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for c in self.chunks for lp in c.logprobs]

    @property
    def final(self) -> GenerationChunk:
        return self.chunks[-1]


async def drain(engine: Engine, request: EngineRequest) -> Outcome:
    """Consume a whole stream; check that only the last chunk is final."""
    chunks = [chunk async for chunk in engine.generate(request)]
    assert chunks and chunks[-1].finish_reason is not None
    assert all(c.finish_reason is None for c in chunks[:-1])
    return Outcome(chunks)


@pytest.fixture
def collect():
    return drain


@pytest.fixture
async def torch_engine_factory():
    """``await make(**options)``: a started TorchEngine (tiny-llama, seed 0 by default)."""
    engines: list[Engine] = []

    async def make(**options) -> Engine:
        options.setdefault("preset", "tiny-llama")
        options.setdefault("seed", 0)
        options.setdefault("stream_interval", 4)
        engine = create_engine("torch", **options)
        engines.append(engine)
        await engine.start()
        return engine

    yield make
    for engine in engines:
        await engine.close()


@pytest.fixture
async def torch_engine(torch_engine_factory):
    return await torch_engine_factory()


@pytest.fixture
async def synthetic_factory():
    """``await make(**options)``: a started SyntheticEngine."""
    engines: list[Engine] = []

    async def make(**options) -> Engine:
        engine = create_engine("synthetic", **options)
        engines.append(engine)
        await engine.start()
        return engine

    yield make
    for engine in engines:
        await engine.close()


@pytest.fixture
def vllm_model_dir(tmp_path: Path) -> Path:
    """A small float32 checkpoint (:data:`vllm_support.CHECKPOINT`) for the vLLM backend's tests."""
    import torch
    from safetensors.torch import save_file
    from vllm_support import CHECKPOINT

    (tmp_path / "config.json").write_text("{}")
    generator = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=generator) for n, s in CHECKPOINT.items()}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.fixture
async def make_vllm(vllm_model_dir):
    """``await make_vllm(fake=None, **options)`` -> (started VllmEngine, its FakeAsyncLLM)."""
    from fake_vllm import FakeAsyncLLM, fake_api

    from replica_agent.engines.vllm_config import VllmEngineConfig
    from replica_agent.engines.vllm_engine import VllmEngine

    engines: list[VllmEngine] = []

    async def make(fake: FakeAsyncLLM | None = None, clock=None, **options):
        fake = fake or FakeAsyncLLM()
        options.setdefault("stream_interval", 4)
        options.setdefault("replica_id", "rep-1")
        extra = {"clock": clock} if clock is not None else {}
        engine = VllmEngine(VllmEngineConfig(model_path=str(vllm_model_dir), **options), api=fake_api(fake), **extra)
        engines.append(engine)
        await engine.start()
        return engine, fake

    yield make
    for engine in engines:
        await engine.close()
