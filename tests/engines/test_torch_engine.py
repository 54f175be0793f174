"""TorchEngine generation: continuous batching, determinism, stop/length,
abort and resume, validation and availability."""

from __future__ import annotations

import asyncio

import pytest

from replica_agent.engines import (
    DuplicateRequest,
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    InvalidRequest,
    SamplingParams,
    TokenSegment,
)
from modeling.presets import save_preset

pytestmark = [pytest.mark.timeout(60), pytest.mark.pins]


def prompt(i: int) -> list[int]:
    """Prompts of varied length (3..9 tokens) so rows need padding when batched."""
    return [(i * 37 + j * 11 + 5) % 256 for j in range(3 + i % 7)]


def greedy(request_id: str, i: int, max_tokens: int = 24, **kw) -> EngineRequest:
    return EngineRequest(request_id, prompt(i), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def seeded(request_id: str, i: int, max_tokens: int = 24) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i, logprobs=True)
    return EngineRequest(request_id, prompt(i), sp)


async def test_sixteen_concurrent_requests_complete_with_right_counts(torch_engine, collect):
    requests = [greedy(f"r{i}", i, max_tokens=10 + i, logprobs=True) for i in range(16)]
    outcomes = await asyncio.gather(*(collect(torch_engine, r) for r in requests))
    for i, out in enumerate(outcomes):
        assert len(out.tokens) == 10 + i
        assert len(out.logprobs) == 10 + i and all(lp <= 0 for lp in out.logprobs)
        assert out.final.finish_reason is FinishReason.LENGTH
        assert out.final.usage.completion_tokens == 10 + i
        assert out.final.usage.prompt_tokens == len(prompt(i))
        assert all(len(c.token_ids) <= 4 for c in out.chunks)  # stream_interval=4
        [segment] = out.final.segments
        assert segment.token_ids == out.tokens and segment.weight_version == 0
    # All 16 shared forward passes: far fewer steps than 16 separate runs would need.
    assert torch_engine.step_count < sum(10 + i for i in range(16)) // 4


async def test_greedy_identical_alone_and_batched_and_across_engines(torch_engine_factory, collect):
    first = await torch_engine_factory()
    second = await torch_engine_factory()
    alone = [(await collect(first, greedy(f"a{i}", i, max_tokens=32))).tokens for i in range(12)]

    # Batched, with half of the requests joining while the others are mid-generation.
    early = [asyncio.ensure_future(collect(second, greedy(f"b{i}", i, max_tokens=32))) for i in range(6)]
    stream = second.generate(greedy("probe", 0, max_tokens=32))
    await anext(stream)  # the batch is running now
    late = [asyncio.ensure_future(collect(second, greedy(f"b{i}", i, max_tokens=32))) for i in range(6, 12)]
    batched = [o.tokens for o in await asyncio.gather(*early, *late)]
    await stream.aclose()

    assert batched == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts really lead to different outputs


async def test_seeded_sampling_is_deterministic_alone_and_batched(torch_engine_factory, collect):
    first = await torch_engine_factory()
    second = await torch_engine_factory()
    alone = [await collect(first, seeded(f"s{i}", i)) for i in range(6)]
    batched = await asyncio.gather(*(collect(second, seeded(f"s{i}", i)) for i in range(6)))
    assert [o.tokens for o in batched] == [o.tokens for o in alone]
    for got, want in zip(batched, alone):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    greedy_run = await collect(first, greedy("g", 0))
    assert alone[0].tokens != greedy_run.tokens  # sampling did not degenerate to greedy


async def test_stop_token_ends_with_stop(torch_engine, collect):
    reference = (await collect(torch_engine, greedy("ref", 3, max_tokens=30))).tokens
    stop_at = 5
    stop_token = reference[stop_at]
    first = reference.index(stop_token)
    out = await collect(torch_engine, greedy("stop", 3, max_tokens=30, stop_token_ids=[stop_token]))
    assert out.final.finish_reason is FinishReason.STOP
    assert out.tokens == reference[: first + 1]


async def test_abort_returns_partial_tokens_within_one_step(torch_engine_factory, collect):
    engine = await torch_engine_factory(stream_interval=1)
    stream = engine.generate(greedy("long", 1, max_tokens=400))
    received = []
    async for chunk in stream:
        received.extend(chunk.token_ids)
        if len(received) >= 5:
            break_step = engine.step_count
            assert await engine.abort(["long"]) == ["long"]
            assert engine.step_count - break_step <= 1
            break
    rest = [c async for c in stream]
    final = rest[-1]
    tokens = received + [t for c in rest for t in c.token_ids]
    assert final.finish_reason is FinishReason.ABORTED
    assert 5 <= len(tokens) <= engine.step_count < 400
    assert final.usage.completion_tokens == len(tokens)
    assert await engine.abort(["long", "unknown"]) == []


async def test_aborted_request_resumes_on_another_engine(torch_engine_factory, collect):
    a = await torch_engine_factory(stream_interval=1, replica_id="a", node_id="n1", weight_version=7)
    b = await torch_engine_factory(replica_id="b", node_id="n2", weight_version=7)
    max_tokens = 40
    uninterrupted = (await collect(b, greedy("full", 2, max_tokens=max_tokens, logprobs=True))).tokens

    stream = a.generate(greedy("req", 2, max_tokens=max_tokens, logprobs=True))
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            await a.abort(["req"])
    partial = chunks[-1]
    assert partial.finish_reason is FinishReason.ABORTED
    prefix = [t for c in chunks for t in c.token_ids]
    assert 3 <= len(prefix) < max_tokens
    assert [s.replica_id for s in partial.segments] == ["a"]

    resumed_req = greedy("req", 2, max_tokens=max_tokens, logprobs=True)
    resumed_req.resume_segments = partial.segments
    resumed = await collect(b, resumed_req)
    assert len(prefix) + len(resumed.tokens) == max_tokens
    assert prefix + resumed.tokens == uninterrupted
    usage = resumed.final.usage
    assert (usage.completion_tokens, usage.resumed_tokens) == (max_tokens, len(prefix))
    segments = resumed.final.segments
    assert [(s.replica_id, s.node_id, s.weight_version) for s in segments] == [("a", "n1", 7), ("b", "n2", 7)]
    assert [t for s in segments for t in s.token_ids] == uninterrupted
    assert all(len(s.logprobs) == len(s.token_ids) for s in segments)


async def test_seeded_sampling_resumes_exactly(torch_engine, collect):
    full = await collect(torch_engine, seeded("x", 4, max_tokens=20))
    request = seeded("x", 4, max_tokens=20)
    request.resume_segments = [TokenSegment(full.tokens[:8], full.logprobs[:8], 0, "elsewhere")]
    rest = await collect(torch_engine, request)
    assert full.tokens[:8] + rest.tokens == full.tokens


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: setattr(r.sampling, "temperature", -1.0),
        lambda r: setattr(r.sampling, "top_p", 0.0),
        lambda r: setattr(r.sampling, "top_p", 1.5),
        lambda r: setattr(r.sampling, "max_tokens", 0),
        lambda r: setattr(r.sampling, "seed", -3),
        lambda r: setattr(r, "prompt_token_ids", []),
        lambda r: setattr(r, "prompt_token_ids", [1, 2, 256]),  # outside the vocabulary
        lambda r: setattr(r.sampling, "max_tokens", 600),  # beyond the 512-token context
        lambda r: setattr(r, "resume_segments", [TokenSegment(list(range(24)))]),  # meets max_tokens
    ],
)
async def test_invalid_requests_raise_invalid_request(torch_engine, collect, mutate):
    request = greedy("bad", 0)
    mutate(request)
    with pytest.raises(InvalidRequest):
        await collect(torch_engine, request)
    assert torch_engine.state is EngineState.ACTIVE


async def test_duplicate_request_id_is_refused(torch_engine, collect):
    stream = torch_engine.generate(greedy("same", 0, max_tokens=100))
    await anext(stream)
    with pytest.raises(DuplicateRequest):
        await collect(torch_engine, greedy("same", 1))
    await stream.aclose()


async def test_paused_and_sleeping_engines_refuse_work(torch_engine, collect):
    await torch_engine.pause("wait")
    assert torch_engine.state is EngineState.PAUSED
    with pytest.raises(EngineUnavailable):
        await collect(torch_engine, greedy("p", 0))
    await torch_engine.resume()
    await collect(torch_engine, greedy("p", 0))

    await torch_engine.sleep(1)
    assert torch_engine.state is EngineState.SLEEPING
    with pytest.raises(EngineUnavailable):
        await collect(torch_engine, greedy("s", 0))
    await torch_engine.wake_up()
    assert torch_engine.state is EngineState.ACTIVE
    await collect(torch_engine, greedy("s", 0))


async def test_pause_wait_drains_and_pause_abort_aborts(torch_engine):
    stream = torch_engine.generate(greedy("drain", 0, max_tokens=60))
    first = await anext(stream)  # the request is running
    await torch_engine.pause("wait")
    rest = [c async for c in stream]  # already complete: pause waited for it
    assert rest[-1].finish_reason is FinishReason.LENGTH
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 60
    await torch_engine.resume()

    stream = torch_engine.generate(greedy("cut", 0, max_tokens=200))
    first = await anext(stream)
    await torch_engine.pause("abort")
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORTED
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 200
    assert torch_engine.state is EngineState.PAUSED


async def test_leaving_a_stream_early_aborts_the_request(torch_engine):
    stream = torch_engine.generate(greedy("left", 0, max_tokens=300))
    await anext(stream)
    await stream.aclose()
    await torch_engine.pause("wait")  # returns once nothing is in flight
    assert torch_engine.step_count < 300  # the request did not run to max_tokens
    snap = torch_engine.load_snapshot()
    assert snap.running == snap.waiting == 0


async def test_load_snapshot_reports_batch_and_latency(torch_engine, collect):
    stream = torch_engine.generate(greedy("busy", 0, max_tokens=100))
    await anext(stream)
    snap = torch_engine.load_snapshot()
    assert snap.running == 1 and snap.waiting == 0
    assert snap.used_tokens >= len(prompt(0)) + 1
    assert snap.kv_cache_usage == pytest.approx(snap.used_tokens / snap.max_total_tokens)
    await stream.aclose()
    await asyncio.gather(*(collect(torch_engine, greedy(f"m{i}", i)) for i in range(4)))
    snap = torch_engine.load_snapshot()
    assert snap.tokens_per_second > 0 and snap.ttft_p95_s > 0
    # both measured (one slow gap can pull the mean above the 95th percentile, so they are not ordered)
    assert snap.itl_mean_s > 0 and snap.itl_p95_s > 0


async def test_local_directory_model_matches_the_preset(tmp_path, torch_engine_factory, collect):
    save_preset("tiny-qwen2", 3, tmp_path / "model")
    from_dir = await torch_engine_factory(preset=None, model_path=str(tmp_path / "model"))
    from_preset = await torch_engine_factory(preset="tiny-qwen2", seed=3)
    a = await collect(from_dir, greedy("d", 5))
    b = await collect(from_preset, greedy("d", 5))
    assert a.tokens == b.tokens


async def test_greedy_output_matches_hugging_face_generate(torch_engine, collect):
    """The padded continuous batch computes what plain ``model.generate`` does."""
    import torch

    from modeling.presets import build_preset_model

    reference_model = build_preset_model("tiny-llama", seed=0).eval()
    requests = [greedy(f"hf{i}", i, max_tokens=20) for i in range(5)]  # prompt lengths 3..7
    outcomes = await asyncio.gather(*(collect(torch_engine, r) for r in requests))
    for request, outcome in zip(requests, outcomes):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.no_grad():
            out = reference_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                           min_new_tokens=20, do_sample=False, pad_token_id=0)
        assert outcome.tokens == out[0, ids.shape[1]:].tolist()


async def test_forward_passes_run_off_the_event_loop_thread(torch_engine, collect):
    import threading

    threads: set[int] = set()
    handle = torch_engine.model.register_forward_pre_hook(lambda *_: threads.add(threading.get_ident()))
    try:
        await collect(torch_engine, greedy("thread", 0, max_tokens=5))
    finally:
        handle.remove()
    assert threads and threading.get_ident() not in threads


async def test_the_torch_engine_refuses_to_start_on_an_unsupported_release(torch_engine_factory, monkeypatch):
    from modeling import versions

    monkeypatch.setattr(versions, "installed", lambda: {"torch": "2.13.0", "transformers": "5.19.0"})
    with pytest.raises(versions.UnsupportedVersion, match=r"transformers 5\.19\.0 \(rollmesh needs >= 5\.20\)"):
        await torch_engine_factory()
