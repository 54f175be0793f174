"""The vLLM backend against a recording fake of vLLM's AsyncLLM (no GPU, no vllm).

Each test checks which vLLM calls the engine makes, with which arguments and
in which order, and how vLLM's outputs become rollmesh chunks. The real
backend runs in ``test_vllm_gpu.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from fake_vllm import (
    EngineDeadError,
    FakeAsyncLLM,
    RequestOutputKind,
    RequestStateStats,
    EngineGenerateError,
    RetryableRequestError,
    VLLMValidationError,
    fake_api,
)
from safetensors.torch import save_file

from replica_agent.engines import (
    BACKENDS,
    DuplicateRequest,
    EngineDead,
    EngineError,
    EngineState,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    TokenSegment,
    WeightMismatch,
    create_engine,
)
from replica_agent.engines.randomness import mix_seed
from replica_agent.engines.vllm_config import VllmEngineConfig
from replica_agent.engines.vllm_engine import VllmEngine
from replica_agent.engines.vllm_worker import EXTENSION_CLASS, LOAD_WEIGHTS

pytestmark = pytest.mark.timeout(60)

CHECKPOINT = {  # float32 on disk; the fake serves bfloat16
    "lm_head.weight": (16, 8),
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (4, 8),
}


def req(rid: str = "r", max_tokens: int = 10, prompt=(1, 2, 3), **sampling) -> GenerationRequest:
    sampling.setdefault("ignore_eos", True)
    return GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


def new_weights(names=CHECKPOINT, value: float = 0.5) -> dict[str, torch.Tensor]:
    return {n: torch.full(CHECKPOINT[n], value, dtype=torch.bfloat16) for n in names}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    generator = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=generator) for n, s in CHECKPOINT.items()}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.fixture
async def make(model_dir):
    """``await make(fake=None, **options)`` -> (started VllmEngine, its FakeAsyncLLM)."""
    engines: list[VllmEngine] = []

    async def make(fake: FakeAsyncLLM | None = None, clock=None, **options):
        fake = fake or FakeAsyncLLM()
        options.setdefault("stream_interval", 4)
        options.setdefault("replica_id", "rep-1")
        extra = {"clock": clock} if clock is not None else {}
        engine = VllmEngine(VllmEngineConfig(model_path=str(model_dir), **options), api=fake_api(fake), **extra)
        engines.append(engine)
        await engine.start()
        return engine, fake

    yield make
    for engine in engines:
        await engine.close()


async def drain(stream):
    return [chunk async for chunk in stream]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def in_flight(engine: VllmEngine, fake: FakeAsyncLLM, request: GenerationRequest, emitted: int):
    """Start consuming ``request`` (manual fake) and release ``emitted`` tokens."""
    task = asyncio.create_task(drain(engine.generate(request)))
    await fake.generate_started.wait()
    fake.generate_started.clear()
    fake.emit(request.request_id, emitted)
    return task


# ------------------------------------------------------------------- set-up
def test_importing_the_backend_loads_neither_vllm_nor_torch():
    code = (
        "import sys\n"
        "import replica_agent.engines.vllm_engine\n"
        "from replica_agent.engines import create_engine\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
async def test_start_without_vllm_explains_what_is_needed(model_dir):
    engine = create_engine("vllm", model_path=str(model_dir))
    with pytest.raises(EngineDead, match="needs a GPU machine with vllm installed"):
        await engine.start()
    assert engine.state is EngineState.DEAD


async def test_engine_arguments(model_dir):
    created: list[dict] = []
    engine = create_engine(
        "vllm", model_path=str(model_dir), memory_fraction=0.6, dtype="bfloat16", seed=7, tensor_parallel_size=2,
        max_batch_size=32, max_model_len=256, engine_args={"enable_prefix_caching": True},
        vllm_api=fake_api(FakeAsyncLLM(), created),
    )
    assert isinstance(engine, VllmEngine) and "vllm" in BACKENDS
    await engine.start()
    await engine.close()
    assert created == [{
        "model": str(model_dir), "dtype": "bfloat16", "seed": 7, "gpu_memory_utilization": 0.6,
        "tensor_parallel_size": 2, "max_num_seqs": 32, "enforce_eager": False, "enable_sleep_mode": True,
        "worker_extension_cls": EXTENSION_CLASS, "max_model_len": 256, "enable_prefix_caching": True,
    }]
    with pytest.raises(InvalidRequest, match="enable_sleep_mode"):
        create_engine("vllm", model_path=str(model_dir), engine_args={"enable_sleep_mode": False})
    with pytest.raises(InvalidRequest, match="config.json"):
        create_engine("vllm", model_path=str(model_dir / "missing"))


# --------------------------------------------------------------- generation
async def test_generate_streams_chunks_logprobs_and_segments(make):
    engine, fake = await make()
    chunks = await drain(engine.generate(req(max_tokens=10, logprobs=True)))
    assert [len(c.token_ids) for c in chunks] == [4, 4, 2]
    assert tokens(chunks) == list(range(10, 20))
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx([-(i + 1) / 10 for i in range(10)])
    final = chunks[-1]
    assert final.finish_reason is FinishReason.LENGTH and all(c.finish_reason is None for c in chunks[:-1])
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.resumed_tokens) == (3, 10, 0)
    segments = [(s.token_ids, s.weight_version, s.replica_id) for s in final.segments]
    assert segments == [(list(range(10, 20)), 0, "rep-1")]
    name, call = fake.calls[0]
    assert name == "generate" and call["prompt"] == {"prompt_token_ids": [1, 2, 3]} and call["request_id"] == "r"


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"temperature": 0.0, "top_k": 0},
         {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "logprobs": None}),
        ({"temperature": 0.7, "top_p": 0.9, "top_k": -3, "seed": 1234},
         {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 1234}),
        ({"top_k": 40, "logprobs": True, "stop_token_ids": [5, 6]},
         {"top_k": 40, "logprobs": 0, "stop_token_ids": [5, 6]}),
        ({"ignore_eos": False}, {"ignore_eos": False, "stop_token_ids": []}),
    ],
)
async def test_sampling_params_mapping(make, sampling, expected):
    engine, fake = await make()
    await drain(engine.generate(req(max_tokens=3, **sampling)))
    params = fake.calls[0][1]["sampling_params"]
    assert params.output_kind is RequestOutputKind.DELTA and params.max_tokens == 3
    assert params.n == 1 and params.detokenize is False
    assert {k: getattr(params, k) for k in expected} == expected


async def test_stop_tokens_and_eos_end_with_stop(make):
    engine, fake = await make()
    fake.script = {"stop": [10, 11, 99, 12], "eos": [10, fake.eos_token_id, 12]}
    chunks = await drain(engine.generate(req("stop", stop_token_ids=[99])))
    assert tokens(chunks) == [10, 11, 99] and chunks[-1].finish_reason is FinishReason.STOP
    chunks = await drain(engine.generate(req("eos", ignore_eos=False)))
    assert tokens(chunks) == [10, 2] and chunks[-1].finish_reason is FinishReason.STOP


async def test_resume_continues_after_the_prefix_within_the_budget(make):
    engine, fake = await make()
    resumed = TokenSegment([50, 51, 52], [-1.0, -1.0, -1.0], weight_version=3, replica_id="other")
    request = req(max_tokens=8, seed=7, logprobs=True)
    request.resume_segments = [resumed]
    chunks = await drain(engine.generate(request))
    call = fake.calls[0][1]
    assert call["prompt"] == {"prompt_token_ids": [1, 2, 3, 50, 51, 52]}
    assert call["sampling_params"].max_tokens == 5 and call["sampling_params"].seed == mix_seed(7, 3)
    assert tokens(chunks) == [10, 11, 12, 13, 14]
    final = chunks[-1]
    assert final.finish_reason is FinishReason.LENGTH
    assert (final.usage.completion_tokens, final.usage.resumed_tokens) == (8, 3)
    assert [s.token_ids for s in final.segments] == [[50, 51, 52], [10, 11, 12, 13, 14]]
    assert final.segments[0].replica_id == "other" and final.segments[1].replica_id == "rep-1"


async def test_tokens_beyond_the_budget_are_never_streamed(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
    request = req(max_tokens=6)
    request.resume_segments = [TokenSegment([50, 51])]
    task = await in_flight(engine, fake, request, 0)
    fake.requests["r"].params.max_tokens = 100  # a misbehaving engine that overruns
    fake.emit("r", 10)
    chunks = await task
    assert tokens(chunks) == [10, 11, 12, 13] and chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].usage.completion_tokens == 6
    assert ("internal_abort", {"request_id": "r"}) in fake.calls  # vLLM's stream was closed


# -------------------------------------------------------------------- abort
async def test_abort_calls_vllm_and_ends_the_stream_aborted(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 2)
    assert await engine.abort(["r", "unknown"]) == ["r"]
    chunks = await task
    assert tokens(chunks) == [10, 11] and chunks[-1].finish_reason is FinishReason.ABORTED
    assert ("abort", {"request_id": ["r"]}) in fake.calls
    assert await engine.abort(["r"]) == [] and fake.names().count("abort") == 1


async def test_abort_ends_the_stream_even_if_vllm_sends_no_final_output(make):
    engine, fake = await make(FakeAsyncLLM(auto=False, abort_emits_final=False))
    engine.ABORT_GRACE_S = 0.05
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.abort(None)
    chunks = await task
    assert tokens(chunks) == [10] and chunks[-1].finish_reason is FinishReason.ABORTED
    assert ("internal_abort", {"request_id": "r"}) in fake.calls


async def test_leaving_a_stream_early_aborts_the_request(make):
    engine, fake = await make(FakeAsyncLLM(auto=False), stream_interval=1)
    async with contextlib.aclosing(engine.generate(req(max_tokens=50))) as stream:
        first = asyncio.ensure_future(anext(stream))
        await fake.generate_started.wait()
        fake.emit("r", 3)
        assert (await first).token_ids == [10]
    await asyncio.wait_for(fake.aborted.wait(), 10)
    assert ("abort", {"request_id": ["r"]}) in fake.calls


async def test_close_aborts_in_flight_requests_and_shuts_vllm_down(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.close()
    assert (await task)[-1].finish_reason is FinishReason.ABORTED
    assert fake.names()[-2:] == ["abort", "shutdown"] and engine.state is EngineState.CLOSED
    with pytest.raises(EngineDead):
        await anext(engine.generate(req("later")))


# -------------------------------------------------------------- pause/sleep
async def test_pause_wait_drains_then_refuses_until_resume(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
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


async def test_pause_abort_aborts_in_flight_first(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.pause("abort")
    assert (await task)[-1].finish_reason is FinishReason.ABORTED
    assert [n for n in fake.names() if n in ("abort", "pause_generation")] == ["abort", "pause_generation"]
    assert ("pause_generation", {"mode": "abort", "clear_cache": False}) in fake.calls
    with pytest.raises(InvalidRequest):
        await engine.pause("keep")


async def test_sleep_aborts_in_flight_then_sleeps_and_wakes_with_vllm_tags(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
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


async def test_level_two_sleep_requires_a_complete_reload(make):
    engine, fake = await make()
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


async def test_waking_without_weights_awaits_them(make):
    engine, _ = await make()
    await engine.sleep(2)
    await engine.wake_up()
    assert engine.state is EngineState.AWAITING_WEIGHTS
    with pytest.raises(EngineUnavailable, match="no weights"):
        await anext(engine.generate(req()))


# ------------------------------------------------------------------ weights
async def test_weight_update_freezes_loads_resets_and_resumes_in_order(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
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


async def test_weight_updates_are_sent_in_bounded_buckets(make):
    engine, fake = await make(weight_bucket_bytes=300, recompute_kv_after_weight_update=False)
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
async def test_a_mismatched_manifest_changes_nothing(make, weights, message):
    engine, fake = await make()
    with pytest.raises(WeightMismatch, match=message):
        await engine.load_weights(weights, version=9)
    assert fake.calls == [] and engine.weight_version == 0
    with pytest.raises(InvalidRequest):
        await engine.load_weights({}, version="v9")


async def test_weight_spec_and_named_weights(make, model_dir):
    engine, _ = await make()
    assert [(s.name, s.dtype, s.shape) for s in engine.weight_spec()] == [
        (name, "bfloat16", shape) for name, shape in sorted(CHECKPOINT.items())
    ]
    from safetensors.torch import load_file

    on_disk = load_file(model_dir / "model.safetensors")
    exported = dict(engine.named_weights())
    assert all(torch.equal(exported[n], on_disk[n].to(torch.bfloat16)) for n in CHECKPOINT)
    update = new_weights(["lm_head.weight"])
    await engine.load_weights(update, version=1)
    assert dict(engine.named_weights())["lm_head.weight"] is update["lm_head.weight"]

    frugal, _ = await make(keep_host_weights=False)
    await frugal.load_weights(update, version=1)
    with pytest.raises(EngineUnavailable, match="keep_host_weights"):
        frugal.named_weights()


# ------------------------------------------------------------ errors, load
async def test_invalid_and_duplicate_requests(make):
    engine, fake = await make(FakeAsyncLLM(auto=False))
    for bad, message in [
        (req(temperature=2.5), "temperature"),
        (req(max_tokens=600), "context"),
        (req(prompt=(1, 300)), "vocabulary"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            await anext(engine.generate(bad))
    task = await in_flight(engine, fake, req(max_tokens=50), 0)
    calls = len(fake.calls)
    with pytest.raises(DuplicateRequest):   # refused by rollmesh: vLLM itself would accept the id twice
        await anext(engine.generate(req()))
    assert len(fake.calls) == calls
    await engine.abort(None)
    await task
    fake.fail_generate = VLLMValidationError("prompt too long for the KV cache", parameter="prompt")
    with pytest.raises(InvalidRequest, match="KV cache"):
        await drain(engine.generate(req("rejected")))
    assert engine.state is EngineState.ACTIVE


async def test_vllms_own_exception_types_map_to_what_they_mean(make):
    # generate() re-raises a validation error as it is and wraps every other failure in EngineGenerateError
    # (vllm/v1/engine/async_llm.py): the wrapped cause decides, never the wrapper's type alone
    engine, fake = await make()
    fake.fail_generate = RetryableRequestError("the scheduler is full")
    with pytest.raises(EngineUnavailable, match="scheduler is full"):
        await drain(engine.generate(req("later")))
    fake.fail_generate = RuntimeError("CUDA error: an illegal memory access")
    with pytest.raises(EngineError, match="illegal memory access") as err:
        await drain(engine.generate(req("broken")))
    assert err.value.reason == "GENERATION_FAILED" and not isinstance(err.value, InvalidRequest)
    fake.fail_generate = EngineGenerateError()
    fake.fail_generate.__cause__ = VLLMValidationError("prompt exceeds max_model_len", parameter="prompt")
    with pytest.raises(InvalidRequest, match="max_model_len"):   # a wrapped validation error is still one
        await drain(engine.generate(req("wrapped")))
    assert engine.state is EngineState.ACTIVE


async def test_a_seed_past_int64_is_folded_into_vllms_range(make):
    engine, fake = await make()
    chunks = await drain(engine.generate(req("big-seed", seed=2**64 - 1)))
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    sent = [c["sampling_params"].seed for n, c in fake.calls if n == "generate"][-1]
    assert sent == (2**64 - 1) & (2**63 - 1)


async def test_a_reset_refused_while_frozen_requests_hold_blocks_preempts_them(make):
    # recompute_kv_after_weight_update off: the frozen requests keep their blocks, vLLM refuses the reset
    # (block_pool.py), and prefix blocks of the old weights would stay reusable by new requests
    engine, fake = await make(FakeAsyncLLM(auto=False), recompute_kv_after_weight_update=False)
    task = await in_flight(engine, fake, req(max_tokens=5), 2)
    await engine.load_weights(new_weights(["lm_head.weight"]), version=1)
    resets = [c for n, c in fake.calls if n == "reset_prefix_cache"]
    assert resets == [{}, {"reset_running_requests": True}] and fake.preempted == ["r"]
    fake.emit("r", 3)
    assert [(c.token_ids, c.weight_version) for c in await task][-1] == ([12, 13, 14], 1)


async def test_a_dead_vllm_engine_kills_the_replica(make):
    engine, fake = await make()
    fake.fail_generate = EngineDeadError("EngineCore encountered an issue")
    with pytest.raises(EngineDead):
        await drain(engine.generate(req()))
    assert engine.state is EngineState.DEAD
    with pytest.raises(EngineDead):
        await engine.pause()

    other, fake = await make()
    fake.errored = True
    with pytest.raises(EngineDead):
        await anext(other.generate(req()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_load_snapshot_from_streamed_outputs(make):
    clock = Clock()
    engine, fake = await make(FakeAsyncLLM(auto=False), clock=clock, stream_interval=1)
    fake.queue_stats = RequestStateStats(queued_ts=1.0, scheduled_ts=1.25)
    clock.now = 10.0
    async with contextlib.aclosing(engine.generate(req(max_tokens=50))) as stream:
        first = asyncio.ensure_future(anext(stream))
        await fake.generate_started.wait()
        snap = engine.load_snapshot()
        assert (snap.running, snap.waiting, snap.used_tokens) == (0, 1, 3)
        clock.now = 10.5
        fake.emit("r", 1)
        await first
        clock.now = 10.7
        fake.emit("r", 1)
        await anext(stream)
        snap = engine.load_snapshot()
        assert (snap.running, snap.waiting, snap.used_tokens, snap.max_total_tokens) == (1, 0, 5, 64 * 16)
        assert snap.kv_cache_usage == pytest.approx(5 / 1024)
        assert snap.queue_time_p95_s == pytest.approx(0.25)  # vLLM's scheduled_ts - queued_ts
        assert snap.ttft_p95_s == pytest.approx(0.5)
        assert (snap.itl_mean_s, snap.itl_p95_s) == (pytest.approx(0.2), pytest.approx(0.2))
        assert snap.tokens_per_second == pytest.approx(2 / 10)  # 2 tokens over the 10 s rate window


async def test_a_replica_paused_on_purpose_stays_paused_through_sleep_and_a_full_wake(make):
    # vLLM's sleep pauses its scheduler and a full wake-up restarts it even after an explicit pause; its
    # is_sleeping() is True for an engine that is only paused
    engine, fake = await make()
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


async def test_a_full_wake_of_a_replica_not_paused_leaves_vllm_running(make):
    engine, fake = await make()
    await engine.sleep(1)
    assert fake._paused                                                     # sleeping paused the scheduler
    await engine.wake_up(None)
    assert not fake._paused and "resume_generation" not in fake.names()    # the wake-up restarted it
    assert engine.state is EngineState.ACTIVE


async def test_vllm_is_built_off_the_event_loop(model_dir):
    """Building vLLM's engine blocks for minutes on a GPU; the loop must keep serving meanwhile."""
    loop_ran = threading.Event()
    fake = FakeAsyncLLM()

    def slow_create(kwargs):
        assert loop_ran.wait(5), "the event loop was blocked while vLLM was being built"
        return fake

    async def ticker():
        await asyncio.sleep(0.05)
        loop_ran.set()

    engine = VllmEngine(VllmEngineConfig(model_path=str(model_dir)),
                        api=dataclasses.replace(fake_api(fake), create_client=slow_create))
    tick = asyncio.ensure_future(ticker())
    try:
        await asyncio.wait_for(engine.start(), 10)
        assert engine.state is EngineState.ACTIVE and tick.done()
    finally:
        await engine.close()


@pytest.mark.parametrize("quantization, loader, reloads", [
    (None, "auto", False), ("fp8", "auto", True), (None, "reload_weights", True), ("fp8", "load_weights", False)])
async def test_quantized_models_take_updates_through_reload_weights(make, quantization, loader, reloads):
    fake = FakeAsyncLLM()
    fake.model_config.quantization = quantization
    engine, fake = await make(fake, weight_loader=loader)
    update = new_weights(["lm_head.weight"])
    await engine.load_weights(update, version=1)
    runner = fake.worker.model_runner
    received = runner.reloaded if reloads else runner.model.loaded
    assert [name for name, _ in received] == ["lm_head.weight"] and received[0][1] is update["lm_head.weight"]
    assert not (runner.model.loaded if reloads else runner.reloaded)
    with pytest.raises(InvalidRequest, match="weight_loader"):
        VllmEngineConfig(model_path=str(engine.config.model_path), weight_loader="magic").validate()


async def test_a_request_reaching_vllm_during_a_frozen_update_runs_after_it_on_the_new_weights(make):
    """vLLM accepts requests while its scheduler is paused and runs them once it resumes."""
    engine, fake = await make(FakeAsyncLLM(auto=True))
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
