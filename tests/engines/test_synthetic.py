"""SyntheticEngine: length distributions, pace under a virtual clock,
determinism, and the shared lifecycle (abort, pause, sleep, weights)."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from replica_agent.engines import (
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    SamplingParams,
    WeightMismatch,
)
from replica_agent.engines.synthetic import VirtualClock

pytestmark = pytest.mark.timeout(30)


def req(rid: str, max_tokens: int = 1000, **kw) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, **kw))


async def lengths(engine, collect, n: int, max_tokens: int = 1000) -> list[int]:
    outs = await asyncio.gather(*(collect(engine, req(f"r{i}", max_tokens)) for i in range(n)))
    return [len(o.tokens) for o in outs]


async def test_fixed_lengths_stop_naturally_or_at_max_tokens(synthetic_factory, collect):
    engine = await synthetic_factory(lengths={"kind": "fixed", "value": 20}, eos_token_id=7)
    out = await collect(engine, req("a"))
    assert len(out.tokens) == 20 and out.tokens[-1] == 7 and 7 not in out.tokens[:-1]
    assert out.final.finish_reason is FinishReason.STOP
    short = await collect(engine, req("b", max_tokens=5))
    assert len(short.tokens) == 5 and short.final.finish_reason is FinishReason.LENGTH
    ignoring = await collect(engine, req("c", max_tokens=50, ignore_eos=True))
    assert len(ignoring.tokens) == 50 and ignoring.final.finish_reason is FinishReason.LENGTH


async def test_uniform_lengths_cover_the_range(synthetic_factory, collect):
    engine = await synthetic_factory(lengths={"kind": "uniform", "min": 10, "max": 30})
    got = await lengths(engine, collect, 300)
    assert min(got) >= 10 and max(got) <= 30
    assert len(set(got)) > 15
    assert statistics.mean(got) == pytest.approx(20, abs=1.5)


async def test_lognormal_lengths_are_capped_with_the_right_median(synthetic_factory, collect):
    engine = await synthetic_factory(lengths={"kind": "lognormal", "mu": 4.0, "sigma": 0.8, "cap": 200})
    got = await lengths(engine, collect, 400, max_tokens=2000)
    assert max(got) <= 200 and got.count(200) > 0  # the cap binds for the upper tail
    assert statistics.median(got) == pytest.approx(math.exp(4.0), rel=0.15)


async def test_per_request_rate_with_a_virtual_clock(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(tokens_per_second=50, clock=clock, sleep=clock.sleep)
    out = await collect(engine, req("a", max_tokens=100, ignore_eos=True))
    assert len(out.tokens) == 100
    assert clock.now == pytest.approx(100 / 50)
    assert engine.load_snapshot().tokens_per_second == pytest.approx(50.0)  # engine younger than the window
    clock.now += 8.0
    assert engine.load_snapshot().tokens_per_second == pytest.approx(10.0)  # 100 tokens in the last 10 s
    clock.now += 10.0
    assert engine.load_snapshot().tokens_per_second == 0.0
    assert engine.load_snapshot().itl_mean_s == pytest.approx(1 / 50)


async def test_aggregate_cap_limits_throughput_under_concurrency(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(
        tokens_per_second=100, aggregate_tokens_per_second=200, clock=clock, sleep=clock.sleep
    )
    outs = await asyncio.gather(*(collect(engine, req(f"r{i}", 50, ignore_eos=True)) for i in range(8)))
    assert all(len(o.tokens) == 50 for o in outs)
    # 8 rows share 200 tok/s: each step takes 8/200 s, each request sees 25 tok/s.
    assert clock.now == pytest.approx(50 * 8 / 200)
    snap = engine.load_snapshot()
    assert snap.itl_p95_s == pytest.approx(8 / 200)


async def test_prefill_rate_adds_time_to_first_token(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(
        tokens_per_second=100, prefill_tokens_per_second=40, clock=clock, sleep=clock.sleep
    )
    await collect(engine, req("a", 1))
    assert clock.now == pytest.approx(0.01 + 4 / 40)
    assert engine.load_snapshot().ttft_p95_s == pytest.approx(0.11)


async def test_tokens_are_deterministic_and_resumable(synthetic_factory, collect):
    first = await synthetic_factory(seed=3, lengths={"kind": "fixed", "value": 40})
    second = await synthetic_factory(seed=3, lengths={"kind": "fixed", "value": 40})
    a = await collect(first, req("same"))
    b = await collect(second, req("same"))
    assert a.tokens == b.tokens
    assert (await collect(second, req("other"))).tokens != a.tokens
    seeded_a = await collect(first, req("x", seed=11))
    seeded_b = await collect(second, req("y", seed=11))
    assert seeded_a.tokens == seeded_b.tokens  # an explicit seed wins over the request id

    partial = a.final.segments[0]
    partial.token_ids = partial.token_ids[:15]
    resumed_request = req("same")
    resumed_request.resume_segments = [partial]
    resumed = await collect(second, resumed_request)
    assert partial.token_ids + resumed.tokens == a.tokens
    assert resumed.final.usage.resumed_tokens == 15


async def test_abort_ends_stream_with_partial_tokens(synthetic_factory):
    clock = VirtualClock()
    engine = await synthetic_factory(tokens_per_second=10, stream_interval=2, tokens_per_step=1, clock=clock,
                                     sleep=clock.sleep)   # token by token: an abort acts within one token
    stream = engine.generate(req("a", max_tokens=1000, ignore_eos=True))
    first = await anext(stream)
    steps = engine.step_count
    assert await engine.abort(None) == ["a"]
    assert engine.step_count - steps <= 1
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORTED
    total = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert 2 <= total <= 3
    assert rest[-1].usage.completion_tokens == total


async def test_waiting_requests_abort_immediately(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(tokens_per_second=10, max_batch_size=1, clock=clock, sleep=clock.sleep)
    running = engine.generate(req("running", ignore_eos=True))
    await anext(running)
    queued = asyncio.ensure_future(collect(engine, req("queued")))
    while engine.load_snapshot().waiting == 0:
        await asyncio.sleep(0)
    assert await engine.abort(["queued"]) == ["queued"]
    out = await queued
    assert out.tokens == [] and out.final.finish_reason is FinishReason.ABORTED
    await running.aclose()


async def test_capacity_limits_admission(synthetic_factory, collect):
    engine = await synthetic_factory(max_total_tokens=30, lengths={"kind": "fixed", "value": 5})
    outs = await asyncio.gather(*(collect(engine, req(f"r{i}", max_tokens=20)) for i in range(3)))
    assert all(len(o.tokens) == 5 for o in outs)  # each reserves 24 of 30 tokens: one at a time


async def test_sleep_wake_and_weight_versions(synthetic_factory, collect):
    engine = await synthetic_factory()
    spec = engine.weight_spec()
    original = dict(engine.named_weights())
    assert [s.name for s in spec] == list(original)
    spec_bytes = sum(math.prod(s.shape) * 4 for s in spec)

    assert await engine.sleep(1) == spec_bytes
    with pytest.raises(EngineUnavailable):
        await collect(engine, req("a"))
    await engine.wake_up()
    assert all(original[n] is t for n, t in engine.named_weights())  # restored as they were

    assert await engine.sleep(2) == spec_bytes
    await engine.wake_up()
    assert engine.state is EngineState.AWAITING_WEIGHTS
    with pytest.raises(EngineUnavailable):
        await collect(engine, req("a"))
    with pytest.raises(WeightMismatch):
        await engine.load_weights({"embed.weight": original["embed.weight"]}, version=5)
    with pytest.raises(WeightMismatch):
        await engine.load_weights({**original, "embed.weight": original["head.weight"]}, version=5)
    await engine.load_weights(original, version=5)
    assert engine.weight_version == 5 and engine.state is EngineState.ACTIVE
    out = await collect(engine, req("a"))
    assert [s.weight_version for s in out.final.segments] == [5]


async def test_pause_modes(synthetic_factory, collect):
    clock = VirtualClock()
    engine = await synthetic_factory(tokens_per_second=100, stream_interval=1, tokens_per_step=1,
                                     lengths={"kind": "fixed", "value": 30}, clock=clock, sleep=clock.sleep)
    stream = engine.generate(req("drain"))
    await anext(stream)
    await engine.pause("wait")
    assert len([c async for c in stream]) == 29  # finished while pause waited
    with pytest.raises(EngineUnavailable):
        await collect(engine, req("refused"))
    await engine.resume()
    stream = engine.generate(req("cut"))
    await anext(stream)
    await engine.pause("abort")
    assert [c async for c in stream][-1].finish_reason is FinishReason.ABORTED


@pytest.mark.parametrize("per_step", [1, 5, 16, 64])
async def test_chunked_steps_keep_tokens_pace_and_lengths(synthetic_factory, collect, per_step):
    """A step of N tokens per row stands for N decode iterations: the same tokens, the same pace, the same
    natural lengths and max_tokens cut as token-by-token steps."""
    clock = VirtualClock()
    engine = await synthetic_factory(seed=5, tokens_per_second=100, tokens_per_step=per_step, stream_interval=7,
                                     flush_interval_s=0, lengths={"kind": "fixed", "value": 37}, clock=clock,
                                     sleep=clock.sleep)
    natural, cut = await asyncio.gather(collect(engine, req("n")), collect(engine, req("c", max_tokens=23)))
    reference = await synthetic_factory(seed=5, tokens_per_step=1, lengths={"kind": "fixed", "value": 37})
    assert natural.tokens == (await collect(reference, req("n"))).tokens
    assert cut.tokens == (await collect(reference, req("c", max_tokens=23))).tokens
    assert len(natural.tokens) == 37 and natural.final.finish_reason is FinishReason.STOP
    assert len(cut.tokens) == 23 and cut.final.finish_reason is FinishReason.LENGTH
    assert clock.now == pytest.approx(37 / 100)    # the longer one's 37 tokens at 100 tok/s
    assert all(len(c.token_ids) <= 7 for c in natural.chunks)
    assert engine.step_count <= -(-37 // per_step) + 1


async def test_chunks_flush_by_time(synthetic_factory, collect):
    """With a flush interval, a chunk leaves once its oldest token has waited that long, long before
    stream_interval tokens are pending; at 0 only the size bound applies."""
    clock = VirtualClock()
    timed = await synthetic_factory(tokens_per_second=100, tokens_per_step=1, stream_interval=1000,
                                    flush_interval_s=0.045, clock=clock, sleep=clock.sleep)
    out = await collect(timed, req("t", max_tokens=40, ignore_eos=True))
    assert [len(c.token_ids) for c in out.chunks] == [6, 6, 6, 6, 6, 6, 4]   # a token every 10 ms
    clock = VirtualClock()
    sized = await synthetic_factory(tokens_per_second=100, tokens_per_step=1, stream_interval=16,
                                    flush_interval_s=0, clock=clock, sleep=clock.sleep)
    out = await collect(sized, req("s", max_tokens=40, ignore_eos=True))
    assert [len(c.token_ids) for c in out.chunks] == [16, 16, 8]
