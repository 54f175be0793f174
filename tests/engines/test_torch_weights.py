"""TorchEngine weights: sleep levels really release memory, wake restores
bit for bit, and load_weights is atomic and versioned."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from replica_agent.engines import (
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    SamplingParams,
    WeightMismatch,
)
from modeling.presets import build_preset_model

pytestmark = pytest.mark.timeout(60)


def request(rid: str = "w", max_tokens: int = 24) -> EngineRequest:
    return EngineRequest(rid, [5, 17, 99, 3], SamplingParams(max_tokens=max_tokens, temperature=0))


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.named_weights()}


def param_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


async def test_weight_spec_matches_named_weights(torch_engine_factory):
    engine = await torch_engine_factory(preset="tiny-qwen2")  # tied embeddings
    spec = engine.weight_spec()
    named = dict(engine.named_weights())
    assert [s.name for s in spec] == list(named)
    assert "lm_head.weight" not in named  # the tied alias is listed once
    for s in spec:
        assert (s.dtype, s.shape) == ("float32", tuple(named[s.name].shape))


async def test_sleep_level_2_releases_weights_until_reloaded(torch_engine, collect):
    before = await collect(torch_engine, request())
    saved = snapshot(torch_engine)
    expected = param_bytes(torch_engine)
    storages = [StorageWeakRef(p.untyped_storage()) for p in torch_engine.model.parameters()]

    freed = await torch_engine.sleep(2)
    gc.collect()
    assert freed == expected
    assert all(ref.expired() for ref in storages)  # no tensor anywhere keeps the old storage
    assert all(p.is_meta for p in torch_engine.model.parameters())
    assert torch_engine.resident_weight_bytes() == 0
    assert torch_engine.state is EngineState.SLEEPING
    with pytest.raises(EngineUnavailable):
        await collect(torch_engine, request())
    with pytest.raises(EngineUnavailable):
        await torch_engine.load_weights(saved, version=1)  # weights still asleep

    await torch_engine.wake_up({"weights", "kv_cache"})
    assert torch_engine.state is EngineState.AWAITING_WEIGHTS
    assert torch_engine.resident_weight_bytes() == expected
    with pytest.raises(EngineUnavailable):
        await collect(torch_engine, request())
    partial = dict(list(saved.items())[:3])
    with pytest.raises(WeightMismatch):
        await torch_engine.load_weights(partial, version=1)  # a complete set is required now

    await torch_engine.load_weights(saved, version=1)
    assert torch_engine.state is EngineState.ACTIVE and torch_engine.weight_version == 1
    after = await collect(torch_engine, request())
    assert after.tokens == before.tokens


async def test_sleep_level_1_then_wake_restores_every_parameter_bit_for_bit(torch_engine, collect):
    before = await collect(torch_engine, request())
    saved = snapshot(torch_engine)
    freed = await torch_engine.sleep(1)
    assert freed == param_bytes_of(saved)
    assert torch_engine.resident_weight_bytes() == 0
    assert all(p.is_meta for p in torch_engine.model.parameters())
    assert await torch_engine.sleep(1) == 0  # already asleep at this level

    await torch_engine.wake_up({"kv_cache"})
    assert torch_engine.state is EngineState.SLEEPING  # weights still away
    await torch_engine.wake_up({"weights"})
    assert torch_engine.state is EngineState.ACTIVE
    restored = dict(torch_engine.named_weights())
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[name], saved[name]) for name in saved)
    assert (await collect(torch_engine, request())).tokens == before.tokens


def param_bytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


async def test_sleep_level_2_after_level_1_drops_the_host_copy(torch_engine):
    expected = param_bytes(torch_engine)
    assert await torch_engine.sleep(1) == expected
    assert await torch_engine.sleep(2) == expected  # the host copy goes too
    await torch_engine.wake_up()
    assert torch_engine.state is EngineState.AWAITING_WEIGHTS


async def test_sleep_aborts_in_flight_requests(torch_engine):
    stream = torch_engine.generate(request("inflight", max_tokens=300))
    await anext(stream)
    await torch_engine.sleep(1)
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORTED


@pytest.mark.parametrize("breakage", ["shape", "name", "dtype"])
async def test_bad_weights_raise_and_old_weights_keep_serving(torch_engine, collect, breakage):
    before = await collect(torch_engine, request())
    saved = snapshot(torch_engine)
    offered = {name: t + 1.0 for name, t in saved.items()}  # would change outputs if applied
    name = "model.layers.0.mlp.up_proj.weight"
    if breakage == "shape":
        offered[name] = torch.zeros(3, 3)
    elif breakage == "name":
        offered["model.layers.9.mlp.up_proj.weight"] = offered[name]
    else:
        offered[name] = offered[name].to(torch.float16)
    with pytest.raises(WeightMismatch):
        await torch_engine.load_weights(offered, version=9)
    assert torch_engine.weight_version == 0
    assert all(torch.equal(t, saved[n]) for n, t in torch_engine.named_weights())
    assert (await collect(torch_engine, request())).tokens == before.tokens


async def test_correct_load_changes_outputs_and_version(torch_engine, collect):
    before = await collect(torch_engine, request())
    other = {n: p.detach() for n, p in build_preset_model("tiny-llama", seed=1).named_parameters()}
    await torch_engine.load_weights(other, version=2)
    assert torch_engine.weight_version == 2
    after = await collect(torch_engine, request())
    assert after.tokens != before.tokens
    assert after.final.segments[0].weight_version == 2
    assert all(torch.equal(t, other[n]) for n, t in torch_engine.named_weights())


async def test_partial_load_and_tied_alias(torch_engine_factory, collect):
    engine = await torch_engine_factory(preset="tiny-qwen2")
    before = await collect(engine, request())
    embed = engine.model.model.embed_tokens.weight
    new_embed = torch.randn(tuple(embed.shape), generator=torch.Generator().manual_seed(5))
    await engine.load_weights({"lm_head.weight": new_embed}, version=4)  # alias of the tied embedding
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert torch.equal(engine.model.model.embed_tokens.weight, new_embed)
    assert (await collect(engine, request())).tokens != before.tokens


async def test_weight_update_mid_generation_splits_segments(torch_engine_factory):
    engine = await torch_engine_factory(stream_interval=1)
    new_weights = {n: p.detach() for n, p in build_preset_model("tiny-llama", seed=2).named_parameters()}
    chunks = []
    async for chunk in engine.generate(request("mid", max_tokens=60)):
        chunks.append(chunk)
        if len(chunks) == 10:
            await engine.load_weights(new_weights, version=3)
    final = chunks[-1]
    assert final.finish_reason is FinishReason.LENGTH
    versions = [s.weight_version for s in final.segments]
    assert versions == [0, 3]
    assert sum(len(s.token_ids) for s in final.segments) == 60
    assert len(final.segments[0].token_ids) >= 10
    for c in chunks:  # every chunk is labelled with the version its tokens came from
        assert c.weight_version in (0, 3)
    token_versions = [c.weight_version for c in chunks for _ in c.token_ids]
    assert token_versions == sorted(token_versions)


async def test_concurrent_generation_survives_sleep_wake_cycles(torch_engine, collect):
    for cycle in range(2):
        streams = [torch_engine.generate(request(f"c{cycle}-{i}", 200)) for i in range(4)]
        for stream in streams:
            await anext(stream)  # all four are in the running batch
        await torch_engine.sleep(1)
        finals = [[c async for c in stream][-1] for stream in streams]
        assert all(f.finish_reason is FinishReason.ABORTED for f in finals)
        await torch_engine.wake_up()
    assert len((await collect(torch_engine, request("after"))).tokens) == 24


async def test_patch_weights_changes_the_served_weights_in_place_or_nothing(torch_engine, collect):
    before = await collect(torch_engine, request())
    saved = snapshot(torch_engine)
    for _ in range(200):   # the finished sequence is cached for reuse once the loop retires it
        if len(torch_engine._runner.prefix):
            break
        await asyncio.sleep(0.01)
    assert len(torch_engine._runner.prefix)
    name = "model.layers.0.mlp.up_proj.weight"

    def refused(named):   # changes a weight, restores it, raises: the old version serves on
        weights = dict(named)
        kept = weights[name].clone()
        weights[name].add_(1.0)
        weights[name].copy_(kept)
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        await torch_engine.patch_weights(refused, version=5)
    assert torch_engine.weight_version == 0 and len(torch_engine._runner.prefix)   # its cache still holds
    assert all(torch.equal(t, saved[n]) for n, t in torch_engine.named_weights())

    def patch(named):
        assert all(t.data_ptr() == p.data_ptr() for (_, t), p in zip(named, torch_engine.model.parameters()))
        dict(named)[name].add_(1.0)

    await torch_engine.patch_weights(patch, version=5)
    assert torch_engine.weight_version == 5 and not len(torch_engine._runner.prefix)   # KV of the old weights
    assert torch.equal(dict(torch_engine.named_weights())[name], saved[name] + 1.0)
    after = await collect(torch_engine, request())
    assert after.tokens != before.tokens and after.final.segments[0].weight_version == 5


async def test_patch_weights_needs_resident_weights_and_can_be_turned_off(torch_engine_factory):
    engine = await torch_engine_factory()
    await engine.sleep(1)
    with pytest.raises(EngineUnavailable, match="not resident"):
        await engine.patch_weights(lambda named: None, version=1)
    off = await torch_engine_factory(delta_in_place=False)
    assert not off.patches_weights_in_place and engine.patches_weights_in_place
    with pytest.raises(EngineUnavailable, match="delta_in_place: false"):
        await off.patch_weights(lambda named: None, version=1)
    assert off.weight_version == 0
