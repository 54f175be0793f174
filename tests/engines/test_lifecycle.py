"""Engine lifecycle shared by every backend (exercised through the cheap
synthetic engine), the factory, and the pure validation and metrics code."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from replica_agent.engines import (
    DuplicateRequest,
    EngineDead,
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    InvalidRequest,
    SamplingParams,
    TokenSegment,
    create_engine,
    validate_request,
)
from replica_agent.engines.metrics import EngineMetrics, percentile
from replica_agent.engines.synthetic import SyntheticEngine, SyntheticEngineConfig, VirtualClock

pytestmark = pytest.mark.timeout(30)


def req(rid: str = "r", max_tokens: int = 100, **kw) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


class Exploding(SyntheticEngine):
    """Fails in its third step, like a backend hitting a device error."""

    async def _execute_step(self, batch):
        if self.step_count == 2:
            raise RuntimeError("device fell off the bus")
        return await super()._execute_step(batch)


async def test_backend_failure_kills_the_engine_and_its_streams():
    engine = Exploding(SyntheticEngineConfig(stream_interval=1, tokens_per_step=1))
    await engine.start()
    received = []
    with pytest.raises(EngineDead):
        async for chunk in engine.generate(req()):
            received.extend(chunk.token_ids)
    assert len(received) == 2
    assert engine.state is EngineState.DEAD
    with pytest.raises(EngineDead):
        await anext(engine.generate(req("later")))
    with pytest.raises(EngineDead):
        await engine.pause()
    await engine.close()


async def test_close_aborts_streams_and_is_idempotent(collect):
    clock = VirtualClock()
    engine = create_engine("synthetic", tokens_per_second=10, clock=clock, sleep=clock.sleep)
    with pytest.raises(EngineUnavailable):
        await anext(engine.generate(req("early")))  # not started yet
    assert engine.state is EngineState.LOADING
    await engine.start()
    stream = engine.generate(req())
    await anext(stream)
    await engine.close()
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORTED
    assert engine.state is EngineState.CLOSED
    await engine.close()
    with pytest.raises(EngineDead):
        await collect(engine, req("after"))


async def test_duplicate_ids_and_bad_arguments(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(tokens_per_second=10, clock=clock, sleep=clock.sleep)
    stream = engine.generate(req("dup"))
    await anext(stream)
    with pytest.raises(DuplicateRequest):
        await collect(engine, req("dup"))
    await stream.aclose()
    with pytest.raises(InvalidRequest):
        await engine.pause("later")
    with pytest.raises(InvalidRequest):
        await engine.sleep(3)
    with pytest.raises(InvalidRequest):
        await engine.wake_up({"weights", "everything"})
    with pytest.raises(InvalidRequest):
        await engine.load_weights({}, version="v2")


def test_factory_rejects_unknown_backends_and_options():
    with pytest.raises(InvalidRequest, match="unknown engine backend"):
        create_engine("vllm-but-misspelt")
    with pytest.raises(InvalidRequest, match="tokens_per_sec"):
        create_engine("synthetic", tokens_per_sec=5)
    with pytest.raises(InvalidRequest, match="exactly one"):
        create_engine("torch")
    with pytest.raises(InvalidRequest, match="config.json"):
        create_engine("torch", model_path="/nonexistent/model")


def test_synthetic_engine_does_not_import_torch():
    code = (
        "import sys, asyncio\n"
        "from replica_agent.engines import create_engine\n"
        "async def main():\n"
        "    e = create_engine('synthetic')\n"
        "    await e.start(); await e.close()\n"
        "asyncio.run(main())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=1.5), "top_k"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_validate_sampling_messages(sampling, message):
    with pytest.raises(InvalidRequest, match=message):
        validate_request(EngineRequest("r", [1], sampling))


def test_validate_request_limits():
    ok = EngineRequest("r", [1, 2], SamplingParams(max_tokens=10))
    validate_request(ok, vocab_size=3, max_model_len=12, max_total_tokens=12)
    with pytest.raises(InvalidRequest, match="context"):
        validate_request(ok, max_model_len=11)
    with pytest.raises(InvalidRequest, match="KV capacity"):
        validate_request(ok, max_total_tokens=11)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        validate_request(ok, vocab_size=2)
    with pytest.raises(InvalidRequest, match="request_id"):
        validate_request(EngineRequest("", [1]))
    resumed = EngineRequest("r", [1], SamplingParams(max_tokens=4), [TokenSegment([1, 2]), TokenSegment([3, 4])])
    with pytest.raises(InvalidRequest, match="meets max_tokens"):
        validate_request(resumed)
    with pytest.raises(InvalidRequest, match="logprobs"):
        validate_request(EngineRequest("r", [1], SamplingParams(max_tokens=4), [TokenSegment([1], [0.1, 0.2])]))


def test_a_request_checked_on_entry_is_checked_against_the_engines_limits_only():
    # what the agent's decoding already refused is not looked at again ...
    checked = EngineRequest("", [1, 2], SamplingParams(max_tokens=10, temperature=-1.0), checked=True)
    validate_request(checked, vocab_size=3, max_model_len=12, max_total_tokens=12)
    # ... the engine's own limits still are
    with pytest.raises(InvalidRequest, match="vocabulary"):
        validate_request(checked, vocab_size=2)
    with pytest.raises(InvalidRequest, match="vocabulary"):
        validate_request(EngineRequest("r", [1], SamplingParams(max_tokens=4), [TokenSegment([7])], checked=True),
                         vocab_size=5)
    with pytest.raises(InvalidRequest, match="context"):
        validate_request(checked, max_model_len=11)
    with pytest.raises(InvalidRequest, match="KV capacity"):
        validate_request(checked, max_total_tokens=11)


def test_percentile_nearest_rank():
    assert percentile([], 95) == 0.0
    assert percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 21)]  # 1..20: rank ceil(0.95 * 20) = 19
    assert percentile(values, 95) == 19.0
    assert percentile(values, 50) == 10.0


def test_metrics_windows_forget_old_samples():
    clock = VirtualClock()
    metrics = EngineMetrics(clock, window_s=5.0, rate_window_s=2.0)
    metrics.record_ttft(1.0)
    metrics.record_itl(0.1)
    metrics.record_itl(0.3)
    metrics.record_tokens(10)
    clock.now = 1.0
    assert metrics.tokens_per_second() == 10.0  # 10 tokens over 1 s of life
    assert metrics.itl_stats() == pytest.approx((0.2, 0.3))
    clock.now = 2.5
    metrics.record_tokens(4)
    assert metrics.tokens_per_second() == 2.0  # only the 4 recent tokens, over the 2 s window
    clock.now = 6.0
    assert metrics.ttft_p95() == 0.0 and metrics.itl_stats() == (0.0, 0.0)


async def test_request_joining_while_others_run_gets_its_own_stream(synthetic_factory, collect):
    engine = await synthetic_factory(stream_interval=3)
    outs = await asyncio.gather(*(collect(engine, req(f"j{i}", 7 + i)) for i in range(5)))
    for i, out in enumerate(outs):
        assert [len(c.token_ids) for c in out.chunks[:-1]] == [3] * ((7 + i - 1) // 3)
        assert out.final.usage.completion_tokens == 7 + i
