"""What the vLLM backend's tests share: a small checkpoint on disk, an engine factory over the recording
fake of vLLM (``make``), requests and stream helpers."""

from __future__ import annotations

import asyncio

import torch
from fake_vllm import (
    FakeAsyncLLM,
)

from replica_agent.engines import (
    EngineRequest,
    SamplingParams,
)
from replica_agent.engines.vllm_engine import VllmEngine


CHECKPOINT = {  # float32 on disk; the fake serves bfloat16
    "lm_head.weight": (16, 8),
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (4, 8),
}


def req(rid: str = "r", max_tokens: int = 10, prompt=(1, 2, 3), **sampling) -> EngineRequest:
    sampling.setdefault("ignore_eos", True)
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


def new_weights(names=CHECKPOINT, value: float = 0.5) -> dict[str, torch.Tensor]:
    return {n: torch.full(CHECKPOINT[n], value, dtype=torch.bfloat16) for n in names}


async def drain(stream):
    return [chunk async for chunk in stream]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def in_flight(engine: VllmEngine, fake: FakeAsyncLLM, request: EngineRequest, emitted: int):
    """Start consuming ``request`` (manual fake) and release ``emitted`` tokens."""
    task = asyncio.create_task(drain(engine.generate(request)))
    await fake.generate_started.wait()
    fake.generate_started.clear()
    fake.emit(request.request_id, emitted)
    return task
