"""``flush_cache`` (SGLang's ``/flush_cache``) on the engines that run here: the next request with a prompt the
cache held computes it again; requests running keep going."""

from __future__ import annotations

import asyncio

import pytest

from replica_agent.engines import EngineRequest, SamplingParams, create_engine

pytestmark = pytest.mark.timeout(60)
PROMPT = [(i * 7 + 3) % 200 for i in range(40)]


def _req(rid: str, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _cached(engine, collect, rid: str) -> int:
    return (await collect(engine, _req(rid))).final.usage.cached_tokens


async def test_the_torch_engine_computes_a_flushed_prompt_again(torch_engine_factory, collect):
    engine = await torch_engine_factory()
    await collect(engine, _req("a"))
    assert await _cached(engine, collect, "b") > 0                   # the prompt's blocks were kept
    running = asyncio.ensure_future(collect(engine, _req("long", max_tokens=40)))
    await asyncio.sleep(0.05)
    await engine.flush_cache()
    assert await _cached(engine, collect, "c") == 0
    assert len((await running).tokens) == 40                           # a running request is not touched
    assert await _cached(engine, collect, "d") > 0                   # and the cache fills again


async def test_the_synthetic_engine_computes_a_flushed_prompt_again(collect):
    engine = create_engine("synthetic", engine_model={"block_size": 16, "speed": 50.0},
                           lengths={"kind": "fixed", "value": 4})
    await engine.start()
    try:
        await collect(engine, _req("a"))
        assert await _cached(engine, collect, "b") > 0
        await engine.flush_cache()
        assert await _cached(engine, collect, "c") == 0
    finally:
        await engine.close()
