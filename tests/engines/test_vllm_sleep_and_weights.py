"""The vLLM backend's pause, sleep and weight updates against the recording fake of vLLM's AsyncLLM: which
vLLM calls happen in which order, what is refused while frozen, and what a wake needs."""

from __future__ import annotations

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_vllm import (
    FakeAsyncLLM,
)

from replica_agent.engines import (
    CacheInUse,
    EngineState,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    WeightMismatch,
)
from replica_agent.engines.vllm_config import VllmEngineConfig
from replica_agent.engines.vllm_worker import LOAD_WEIGHTS

from vllm_support import CHECKPOINT, drain, in_flight, new_weights, req, tokens

pytestmark = pytest.mark.timeout(60)


# -------------------------------------------------------------- pause/sleep
async def test_pause_wait_drains_then_refuses_until_resume(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=5), 2)
    pausing = asyncio.create_task(engine.pause("wait"))
    await fake.paused.wait()
    assert not pausing.done()  # the in-flight request has not finished
    fake.emit("r", 3)
    await pausing
    assert (await task)[-1].finish_reason is FinishReason.LENGTH
    assert ("pause_generation", {"mode": "wait", "clear_cache": False}) in fake.calls
    assert engine.state is EngineState.PAUSED
    with pytest.raises(EngineUnavailable, match="paused"):
        await anext(engine.generate(req("next")))
    await engine.resume()
    assert fake.names()[-1] == "resume_generation" and engine.state is EngineState.ACTIVE


async def test_flush_cache_resets_the_prefix_cache_unless_requests_hold_it(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    await engine.flush_cache()
    assert fake.calls[-1] == ("reset_prefix_cache", {})
    task = await in_flight(engine, fake, req(max_tokens=5), 2)
    with pytest.raises(CacheInUse):
        await engine.flush_cache()                      # never preempts a running request for a flush
    assert fake.calls[-1] == ("reset_prefix_cache", {})
    fake.emit("r", 3)
    assert (await task)[-1].finish_reason is FinishReason.LENGTH


async def test_pause_abort_aborts_in_flight_first(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.pause("abort")
    assert (await task)[-1].finish_reason is FinishReason.ABORTED
    assert [n for n in fake.names() if n in ("abort", "pause_generation")] == ["abort", "pause_generation"]
    assert ("pause_generation", {"mode": "abort", "clear_cache": False}) in fake.calls
    with pytest.raises(InvalidRequest):
        await engine.pause("keep")


async def test_sleep_aborts_in_flight_then_sleeps_and_wakes_with_vllm_tags(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    freed = await engine.sleep(1)
    assert (await task)[-1].finish_reason is FinishReason.ABORTED
    names = fake.names()
    assert names.index("abort") < names.index("sleep") and ("sleep", {"level": 1}) in fake.calls
    assert freed == fake.weight_bytes + fake.kv_bytes
    assert engine.state is EngineState.SLEEPING and await engine.is_sleeping()
    with pytest.raises(EngineUnavailable, match="asleep"):
        await anext(engine.generate(req("while-asleep")))
    with pytest.raises(EngineUnavailable):
        engine.named_weights()
    assert len(engine.weight_spec()) == 3
    assert await engine.sleep(1) == 0 and fake.names().count("sleep") == 1
    await engine.wake_up(None)
    assert fake.calls[-1] == ("wake_up", {"tags": ["weights", "kv_cache"]})
    assert engine.state is EngineState.ACTIVE and not await engine.is_sleeping()
    with pytest.raises(InvalidRequest):
        await engine.wake_up({"weights", "graphs"})


async def test_level_two_sleep_requires_a_complete_reload(make_vllm):
    engine, fake = await make_vllm()
    await engine.sleep(2)
    assert ("sleep", {"level": 2}) in fake.calls
    await engine.wake_up({"weights"})
    assert fake.calls[-1] == ("wake_up", {"tags": ["weights"]}) and engine.state is EngineState.SLEEPING
    before = len(fake.calls)
    with pytest.raises(WeightMismatch, match="complete set"):
        await engine.load_weights(new_weights(["lm_head.weight"]), version=5)
    assert len(fake.calls) == before
    await engine.load_weights(new_weights(), version=5)
    assert fake.names()[before:] == ["collective_rpc", "reset_prefix_cache"]  # nothing in flight: no pause
    assert sorted(fake.loaded) == sorted(CHECKPOINT)
    await engine.wake_up({"kv_cache"})
    assert fake.calls[-1] == ("wake_up", {"tags": ["kv_cache"]})
    assert engine.state is EngineState.ACTIVE and engine.weight_version == 5
    chunks = await drain(engine.generate(req(max_tokens=2)))
    assert chunks[-1].segments[0].weight_version == 5


async def test_waking_without_weights_awaits_them(make_vllm):
    engine, _ = await make_vllm()
    await engine.sleep(2)
    await engine.wake_up()
    assert engine.state is EngineState.AWAITING_WEIGHTS
    with pytest.raises(EngineUnavailable, match="no weights"):
        await anext(engine.generate(req()))


# ------------------------------------------------------------------ weights
async def test_weight_update_freezes_loads_resets_and_resumes_in_order(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=5), 2)
    update = new_weights(["lm_head.weight"])
    before = len(fake.calls)
    await engine.load_weights(update, version=1)
    assert fake.calls[before:] == [
        ("pause_generation", {"mode": "keep", "clear_cache": True}),
        ("collective_rpc", {
            "method": LOAD_WEIGHTS, "args": (),
            "kwargs": {"weights": [("lm_head.weight", update["lm_head.weight"])], "reload": False},
        }),
        ("reset_prefix_cache", {}),
        ("resume_generation", {}),
    ]
    fake.emit("r", 3)
    chunks = await task
    assert [(c.token_ids, c.weight_version) for c in chunks] == [([10, 11], 0), ([12, 13, 14], 1)]
    assert [(s.token_ids, s.weight_version) for s in chunks[-1].segments] == [([10, 11], 0), ([12, 13, 14], 1)]
    assert engine.weight_version == 1


async def test_weight_updates_are_sent_in_bounded_buckets(make_vllm):
    engine, fake = await make_vllm(weight_bucket_bytes=300, recompute_kv_after_weight_update=False)
    await engine.load_weights(new_weights(), version=2)  # 256 + 256 + 64 bytes
    payloads = [c["kwargs"]["weights"] for n, c in fake.calls if n == "collective_rpc"]
    assert [[name for name, _ in p] for p in payloads] == [
        ["lm_head.weight"], ["model.embed_tokens.weight"], ["model.layers.0.mlp.up_proj.weight"],
    ]
    assert ("pause_generation", {"mode": "keep", "clear_cache": False}) in fake.calls


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"lm_head.weight": torch.zeros(16, 9, dtype=torch.bfloat16)}, "shape"),
        ({"lm_head.weight": torch.zeros(16, 8)}, "dtype float32"),
        ({"model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}, "unknown weight"),
        ({"lm_head.weight": [[0.0] * 8] * 16}, "expected a tensor"),
    ],
)
async def test_a_mismatched_manifest_changes_nothing(make_vllm, weights, message):
    engine, fake = await make_vllm()
    with pytest.raises(WeightMismatch, match=message):
        await engine.load_weights(weights, version=9)
    assert fake.calls == [] and engine.weight_version == 0
    with pytest.raises(InvalidRequest):
        await engine.load_weights({}, version="v9")


async def test_weight_spec_and_named_weights(make_vllm, vllm_model_dir):
    engine, _ = await make_vllm()
    assert [(s.name, s.dtype, s.shape) for s in engine.weight_spec()] == [
        (name, "bfloat16", shape) for name, shape in sorted(CHECKPOINT.items())
    ]
    from safetensors.torch import load_file

    on_disk = load_file(vllm_model_dir / "model.safetensors")
    exported = dict(engine.named_weights())
    assert all(torch.equal(exported[n], on_disk[n].to(torch.bfloat16)) for n in CHECKPOINT)
    update = new_weights(["lm_head.weight"])
    await engine.load_weights(update, version=1)
    assert dict(engine.named_weights())["lm_head.weight"] is update["lm_head.weight"]

    frugal, _ = await make_vllm(keep_host_weights=False)
    await frugal.load_weights(update, version=1)
    with pytest.raises(EngineUnavailable, match="keep_host_weights"):
        frugal.named_weights()


async def test_a_replica_paused_on_purpose_stays_paused_through_sleep_and_a_full_wake(make_vllm):
    # vLLM's sleep pauses its scheduler and a full wake-up restarts it even after an explicit pause; its
    # is_sleeping() is True for an engine that is only paused
    engine, fake = await make_vllm()
    await engine.pause("wait")
    assert await fake.is_sleeping() and not await engine.is_sleeping()     # paused, awake
    await engine.sleep(1)
    assert await engine.is_sleeping()
    await engine.wake_up(None)
    assert fake._paused and fake.calls[-1] == ("pause_generation", {"mode": "wait", "clear_cache": False})
    assert not await engine.is_sleeping() and engine.state is EngineState.PAUSED
    await engine.resume()
    assert not fake._paused and fake.calls[-1] == ("resume_generation", {})
    chunks = await drain(engine.generate(req("after", max_tokens=2)))
    assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_a_full_wake_of_a_replica_not_paused_leaves_vllm_running(make_vllm):
    engine, fake = await make_vllm()
    await engine.sleep(1)
    assert fake._paused                                                     # sleeping paused the scheduler
    await engine.wake_up(None)
    assert not fake._paused and "resume_generation" not in fake.names()    # the wake-up restarted it
    assert engine.state is EngineState.ACTIVE


@pytest.mark.parametrize("quantization, loader, reloads", [
    (None, "auto", False), ("fp8", "auto", True), (None, "reload_weights", True), ("fp8", "load_weights", False)])
async def test_quantized_models_take_updates_through_reload_weights(make_vllm, quantization, loader, reloads):
    fake = FakeAsyncLLM()
    fake.model_config.quantization = quantization
    engine, fake = await make_vllm(fake, weight_loader=loader)
    update = new_weights(["lm_head.weight"])
    await engine.load_weights(update, version=1)
    runner = fake.worker.model_runner
    received = runner.reloaded if reloads else runner.model.loaded
    assert [name for name, _ in received] == ["lm_head.weight"] and received[0][1] is update["lm_head.weight"]
    assert not (runner.model.loaded if reloads else runner.reloaded)
    with pytest.raises(InvalidRequest, match="weight_loader"):
        VllmEngineConfig(model_path=str(engine.config.model_path), weight_loader="magic").validate()


async def test_a_request_reaching_vllm_during_a_frozen_update_runs_after_it_on_the_new_weights(make_vllm):
    """vLLM accepts requests while its scheduler is paused and runs them once it resumes."""
    engine, fake = await make_vllm(FakeAsyncLLM(auto=True))
    original = fake.pause_generation
    late: list = []

    async def pause_then_submit(**kwargs):
        await original(**kwargs)
        late.append(asyncio.ensure_future(drain(engine.generate(req("late", max_tokens=4)))))
        await asyncio.sleep(0)   # the request reaches vLLM while its scheduler is paused
        await asyncio.sleep(0)

    fake.pause_generation = pause_then_submit
    await engine.load_weights(new_weights(["lm_head.weight"]), version=7)
    chunks = await asyncio.wait_for(late[0], 5)
    assert tokens(chunks) == [10, 11, 12, 13] and [s.weight_version for s in chunks[-1].segments] == [7]
    assert fake.calls[[n for n, _ in fake.calls].index("generate") - 1][0] == "pause_generation"
