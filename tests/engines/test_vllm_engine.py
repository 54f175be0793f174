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

from replica_agent.engines import (
    BACKENDS,
    DuplicateRequest,
    EngineDead,
    EngineError,
    EngineState,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    TokenSegment,
    create_engine,
)
from replica_agent.engines.randomness import mix_seed
from replica_agent.engines.vllm_config import VllmEngineConfig
from replica_agent.engines.vllm_engine import VllmEngine
from replica_agent.engines.vllm_worker import EXTENSION_CLASS

from vllm_support import drain, in_flight, new_weights, req, tokens

pytestmark = pytest.mark.timeout(60)


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
async def test_start_without_vllm_explains_what_is_needed(vllm_model_dir):
    engine = create_engine("vllm", model_path=str(vllm_model_dir))
    with pytest.raises(EngineDead, match="needs a GPU machine with vllm installed"):
        await engine.start()
    assert engine.state is EngineState.DEAD


async def test_engine_arguments(vllm_model_dir):
    created: list[dict] = []
    engine = create_engine(
        "vllm", model_path=str(vllm_model_dir), memory_fraction=0.6, dtype="bfloat16", seed=7, tensor_parallel_size=2,
        max_batch_size=32, max_model_len=256, engine_args={"enable_prefix_caching": True},
        vllm_api=fake_api(FakeAsyncLLM(), created),
    )
    assert isinstance(engine, VllmEngine) and "vllm" in BACKENDS
    await engine.start()
    await engine.close()
    assert created == [{
        "model": str(vllm_model_dir), "dtype": "bfloat16", "seed": 7, "gpu_memory_utilization": 0.6,
        "tensor_parallel_size": 2, "max_num_seqs": 32, "enforce_eager": False, "enable_sleep_mode": True,
        "worker_extension_cls": EXTENSION_CLASS, "max_model_len": 256, "enable_prefix_caching": True,
    }]
    with pytest.raises(InvalidRequest, match="enable_sleep_mode"):
        create_engine("vllm", model_path=str(vllm_model_dir), engine_args={"enable_sleep_mode": False})
    with pytest.raises(InvalidRequest, match="config.json"):
        create_engine("vllm", model_path=str(vllm_model_dir / "missing"))


# --------------------------------------------------------------- generation
async def test_generate_streams_chunks_logprobs_and_segments(make_vllm):
    engine, fake = await make_vllm()
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
        ({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 1234},
         {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 1234}),
        ({"top_k": 40, "logprobs": True, "stop_token_ids": [5, 6]},
         {"top_k": 40, "logprobs": 0, "stop_token_ids": [5, 6]}),
        ({"ignore_eos": False}, {"ignore_eos": False, "stop_token_ids": []}),
    ],
)
async def test_sampling_params_mapping(make_vllm, sampling, expected):
    engine, fake = await make_vllm()
    await drain(engine.generate(req(max_tokens=3, **sampling)))
    params = fake.calls[0][1]["sampling_params"]
    assert params.output_kind is RequestOutputKind.DELTA and params.max_tokens == 3
    assert params.n == 1 and params.detokenize is False
    assert {k: getattr(params, k) for k in expected} == expected


async def test_stop_tokens_and_eos_end_with_stop(make_vllm):
    engine, fake = await make_vllm()
    fake.script = {"stop": [10, 11, 99, 12], "eos": [10, fake.eos_token_id, 12]}
    chunks = await drain(engine.generate(req("stop", stop_token_ids=[99])))
    assert tokens(chunks) == [10, 11, 99] and chunks[-1].finish_reason is FinishReason.STOP
    chunks = await drain(engine.generate(req("eos", ignore_eos=False)))
    assert tokens(chunks) == [10, 2] and chunks[-1].finish_reason is FinishReason.STOP


async def test_resume_continues_after_the_prefix_within_the_budget(make_vllm):
    engine, fake = await make_vllm()
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


async def test_tokens_beyond_the_budget_are_never_streamed(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
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
async def test_abort_calls_vllm_and_ends_the_stream_aborted(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 2)
    assert await engine.abort(["r", "unknown"]) == ["r"]
    chunks = await task
    assert tokens(chunks) == [10, 11] and chunks[-1].finish_reason is FinishReason.ABORTED
    assert ("abort", {"request_id": ["r"]}) in fake.calls
    assert await engine.abort(["r"]) == [] and fake.names().count("abort") == 1


async def test_abort_ends_the_stream_even_if_vllm_sends_no_final_output(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False, abort_emits_final=False))
    engine.ABORT_GRACE_S = 0.05
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.abort(None)
    chunks = await task
    assert tokens(chunks) == [10] and chunks[-1].finish_reason is FinishReason.ABORTED
    assert ("internal_abort", {"request_id": "r"}) in fake.calls


async def test_leaving_a_stream_early_aborts_the_request(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False), stream_interval=1)
    async with contextlib.aclosing(engine.generate(req(max_tokens=50))) as stream:
        first = asyncio.ensure_future(anext(stream))
        await fake.generate_started.wait()
        fake.emit("r", 3)
        assert (await first).token_ids == [10]
    await asyncio.wait_for(fake.aborted.wait(), 10)
    assert ("abort", {"request_id": ["r"]}) in fake.calls


async def test_close_aborts_in_flight_requests_and_shuts_vllm_down(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
    task = await in_flight(engine, fake, req(max_tokens=50), 1)
    await engine.close()
    assert (await task)[-1].finish_reason is FinishReason.ABORTED
    assert fake.names()[-2:] == ["abort", "shutdown"] and engine.state is EngineState.CLOSED
    with pytest.raises(EngineDead):
        await anext(engine.generate(req("later")))


# ------------------------------------------------------------ errors, load
async def test_invalid_and_duplicate_requests(make_vllm):
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False))
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


async def test_vllms_own_exception_types_map_to_what_they_mean(make_vllm):
    # generate() re-raises a validation error as it is and wraps every other failure in EngineGenerateError
    # (vllm/v1/engine/async_llm.py): the wrapped cause decides, never the wrapper's type alone
    engine, fake = await make_vllm()
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


async def test_a_seed_past_int64_is_folded_into_vllms_range(make_vllm):
    engine, fake = await make_vllm()
    chunks = await drain(engine.generate(req("big-seed", seed=2**64 - 1)))
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    sent = [c["sampling_params"].seed for n, c in fake.calls if n == "generate"][-1]
    assert sent == (2**64 - 1) & (2**63 - 1)


async def test_a_reset_refused_while_frozen_requests_hold_blocks_preempts_them(make_vllm):
    # recompute_kv_after_weight_update off: the frozen requests keep their blocks, vLLM refuses the reset
    # (block_pool.py), and prefix blocks of the old weights would stay reusable by new requests
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False), recompute_kv_after_weight_update=False)
    task = await in_flight(engine, fake, req(max_tokens=5), 2)
    await engine.load_weights(new_weights(["lm_head.weight"]), version=1)
    resets = [c for n, c in fake.calls if n == "reset_prefix_cache"]
    assert resets == [{}, {"reset_running_requests": True}] and fake.preempted == ["r"]
    fake.emit("r", 3)
    assert [(c.token_ids, c.weight_version) for c in await task][-1] == ([12, 13, 14], 1)


async def test_a_dead_vllm_engine_kills_the_replica(make_vllm):
    engine, fake = await make_vllm()
    fake.fail_generate = EngineDeadError("EngineCore encountered an issue")
    with pytest.raises(EngineDead):
        await drain(engine.generate(req()))
    assert engine.state is EngineState.DEAD
    with pytest.raises(EngineDead):
        await engine.pause()

    other, fake = await make_vllm()
    fake.errored = True
    with pytest.raises(EngineDead):
        await anext(other.generate(req()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_load_snapshot_from_streamed_outputs(make_vllm):
    clock = Clock()
    engine, fake = await make_vllm(FakeAsyncLLM(auto=False), clock=clock, stream_interval=1)
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


async def test_vllm_is_built_off_the_event_loop(vllm_model_dir):
    """Building vLLM's engine blocks for minutes on a GPU; the loop must keep serving meanwhile."""
    loop_ran = threading.Event()
    fake = FakeAsyncLLM()

    def slow_create(kwargs):
        assert loop_ran.wait(5), "the event loop was blocked while vLLM was being built"
        return fake

    async def ticker():
        await asyncio.sleep(0.05)
        loop_ran.set()

    engine = VllmEngine(VllmEngineConfig(model_path=str(vllm_model_dir)),
                        api=dataclasses.replace(fake_api(fake), create_client=slow_create))
    tick = asyncio.ensure_future(ticker())
    try:
        await asyncio.wait_for(engine.start(), 10)
        assert engine.state is EngineState.ACTIVE and tick.done()
    finally:
        await engine.close()
