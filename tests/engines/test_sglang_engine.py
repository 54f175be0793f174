"""The SGLang backend against a fake SGLang server (a real HTTP server process, SGLang 0.5.x's shapes).

The fake (tests/engines/fake_sglang.py) runs as its own process: the weight
update group it joins is a real gloo process group with this test process.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from replica_agent.engines import (
    CacheInUse,
    EngineDead,
    EngineState,
    EngineUnavailable,
    FinishReason,
    EngineRequest,
    InvalidRequest,
    SamplingParams,
    TokenSegment,
    WeightMismatch,
    create_engine,
)
from replica_agent.engines.sglang_engine import SglangEngine
from replica_agent.engines.sglang_http import SglangClient, finish_reason, new_tokens
from replica_agent.engines.sglang_load import ServerLoad
from tests.engines.fake_sglang import FakeSglangProcess, write_model
from tests.processes import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

FAKE = [sys.executable, "-m", "tests.engines.fake_sglang"]
SHAPES = {"lm_head.weight": (32, 8), "model.embed_tokens.weight": (32, 8)}
VOCAB, EOS = 32, 31


def req(rid: str = "r", max_tokens: int = 9, prompt=(1, 2, 3), **sampling) -> EngineRequest:
    sampling.setdefault("ignore_eos", True)
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))


def expected_tokens(context: list[int], count: int, weight_sum: float) -> list[int]:
    """What the fake generates greedily (its "model": context, position and one weight's sum)."""
    out: list[int] = []
    for i in range(count):
        out.append((sum((context + out)[-4:]) + 7 * i + int(round(weight_sum * 1000))) % VOCAB)
    return out


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path, SHAPES, vocab=VOCAB, eos=EOS)


@pytest.fixture
def servers(model_dir):
    started: list[FakeSglangProcess] = []

    def start(*flags: str) -> FakeSglangProcess:
        server = FakeSglangProcess(model_dir, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def make(model_dir, servers):
    """``await make(*server_flags, **options)`` -> (started engine attached to a new fake server, the server)."""
    engines: list[SglangEngine] = []

    async def make(*flags: str, **options):
        server = servers(*flags)
        options.setdefault("stream_interval", 4)
        options.setdefault("weight_backend", "gloo")
        options.setdefault("metrics_interval_s", 0.1)
        engine = create_engine("sglang", model_path=str(model_dir), url=server.url, **options)
        engines.append(engine)
        await engine.start()
        return engine, server

    yield make
    for engine in engines:
        await engine.close()


async def drain(stream):
    return [chunk async for chunk in stream]


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# ------------------------------------------------------------------ pure parts
def test_new_tokens_reads_cumulative_and_incremental_streams():
    cumulative = {"output_ids": [5, 6, 7], "meta_info": {"completion_tokens": 3,
                                                          "output_token_logprobs": [[-1, 5, None], [-2, 6, None],
                                                                                    [-3, 7, None]]}}
    assert new_tokens(cumulative, 1) == ([6, 7], [-2.0, -3.0])
    incremental = {"output_ids": [7], "meta_info": {"completion_tokens": 3, "output_token_logprobs": [[-3, 7, None]]}}
    assert new_tokens(incremental, 2) == ([7], [-3.0])
    ids, logprobs = new_tokens({"output_ids": [4], "meta_info": {"completion_tokens": 1}}, 0)
    assert ids == [4] and math.isnan(logprobs[0])
    assert finish_reason({"finish_reason": None}) is None
    assert finish_reason({"finish_reason": {"type": "length", "length": 3}}) is FinishReason.LENGTH
    assert finish_reason({"finish_reason": {"type": "abort"}}) is FinishReason.ABORTED
    assert finish_reason({"finish_reason": {"type": "weird"}}) is FinishReason.ABORTED


def test_server_load_takes_percentiles_of_recent_observations():
    def page(running: int, fast: int, slow: int) -> str:
        return "\n".join([
            "# TYPE sglang:num_running_reqs gauge", f'sglang:num_running_reqs{{model_name="m"}} {running}',
            "# TYPE sglang:token_usage gauge", 'sglang:token_usage{model_name="m"} 0.25',
            "# TYPE sglang:time_to_first_token_seconds histogram",
            f'sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {fast}',
            f'sglang:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {fast + slow}',
            f'sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {fast + slow}',
            'sglang:time_to_first_token_seconds_sum{model_name="m"} 1', 
            f'sglang:time_to_first_token_seconds_count{{model_name="m"}} {fast + slow}', ""])

    load = ServerLoad()
    load.update(page(3, 100, 0))
    assert (load.running, load.token_usage) == (3, 0.25) and load.ttft_p95 <= 0.1
    load.update(page(1, 100, 20))   # the 20 new observations were all slow
    assert load.running == 1 and 0.1 < load.ttft_p95 <= 1.0
    load.update(page(1, 100, 20))   # nothing new: the last value stays
    assert 0.1 < load.ttft_p95 <= 1.0
    with pytest.raises(ValueError):
        load.update("this is { not prometheus")


def test_options_are_checked_before_anything_starts(model_dir):
    with pytest.raises(InvalidRequest, match="url must look like"):
        create_engine("sglang", model_path=str(model_dir), url="localhost")
    with pytest.raises(InvalidRequest, match="may not set"):
        create_engine("sglang", model_path=str(model_dir), server_args=["--port=5"])
    with pytest.raises(InvalidRequest, match="weight_backend"):
        create_engine("sglang", model_path=str(model_dir), weight_backend="mpi")
    with pytest.raises(InvalidRequest, match="config.json"):
        create_engine("sglang", model_path=str(model_dir / "nope"))
    with pytest.raises(InvalidRequest, match="unknown option"):
        create_engine("sglang", model_path=str(model_dir), colour="red")


def test_launch_command_has_the_flags_the_backend_relies_on(model_dir):
    engine = create_engine("sglang", model_path=str(model_dir), weights_cpu_backup=True, tensor_parallel_size=2,
                           server_args=["--context-length", "4096"])
    command = engine.config.launch_command(31000)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics", "--enable-weights-cpu-backup"):
        assert flag in command
    assert command[command.index("--port") + 1] == "31000" and command[command.index("--tp-size") + 1] == "2"
    assert command[-2:] == ["--context-length", "4096"]


# ------------------------------------------------------------------ generation
@pytest.mark.parametrize("flags", [(), ("--incremental-streaming-output",)], ids=["cumulative", "incremental"])
async def test_generate_streams_chunks_logprobs_and_segments(make, flags):
    engine, server = await make(*flags, replica_id="rep", node_id="n")
    assert engine.state is EngineState.ACTIVE
    chunks = await drain(engine.generate(req(max_tokens=9, logprobs=True)))
    assert tokens(chunks) == expected_tokens([1, 2, 3], 9, server.state()["weight_sum"])
    assert [len(c.token_ids) for c in chunks] == [4, 4, 1]
    final = chunks[-1]
    assert final.finish_reason is FinishReason.LENGTH and final.usage.completion_tokens == 9
    assert len([lp for c in chunks for lp in c.logprobs]) == 9
    assert [(s.replica_id, s.node_id, len(s.token_ids)) for s in final.segments] == [("rep", "n", 9)]


async def test_stop_token_and_resume_within_the_budget(make):
    engine, server = await make()
    weight_sum = server.state()["weight_sum"]
    full = expected_tokens([1, 2, 3], 12, weight_sum)
    stop_at = full[5]
    chunks = await drain(engine.generate(req(max_tokens=12, stop_token_ids=[stop_at])))
    assert chunks[-1].finish_reason is FinishReason.STOP and tokens(chunks)[-1] == stop_at
    resumed = EngineRequest("r2", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True),
                                resume_segments=[TokenSegment([9, 9], [], 0, "old", "n0")])
    chunks = await drain(engine.generate(resumed))
    assert len(tokens(chunks)) == 4 and chunks[-1].usage.completion_tokens == 6
    assert tokens(chunks) == expected_tokens([1, 2, 3, 9, 9], 4, weight_sum)


async def test_rejections_are_invalid_requests_and_change_nothing(make):
    engine, server = await make()
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await drain(engine.generate(req(prompt=(VOCAB + 5,))))
    with pytest.raises(InvalidRequest, match="context"):
        await drain(engine.generate(req(max_tokens=200)))
    client = SglangClient(server.url, timeout_s=5)
    try:
        with pytest.raises(InvalidRequest, match="top_k"):
            async for _ in client.generate({"input_ids": [1], "rid": "x", "stream": True,
                                            "sampling_params": {"top_k": 0}}):
                pass
    finally:
        await client.close()
    assert engine.state is EngineState.ACTIVE and server.state()["running"] == []


async def test_abort_and_leaving_early_end_requests_on_the_server(make):
    engine, server = await make("--fake-token-delay", "0.05")
    stream = engine.generate(req("a", max_tokens=60))
    first = await stream.__anext__()
    assert await engine.abort(["a"]) == ["a"]
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORTED
    assert 0 < len(first.token_ids) + len(tokens(rest)) < 60
    early = engine.generate(req("b", max_tokens=60))
    await early.__anext__()
    await early.aclose()
    await wait_until(lambda: server.state()["running"] == [], 10, what="the server ended both requests")
    assert server.state()["calls"].count("/abort_request") == 2


async def test_pause_refuses_new_requests_until_resume(make):
    engine, server = await make("--fake-token-delay", "0.02")
    running = asyncio.ensure_future(drain(engine.generate(req("w", max_tokens=10))))
    await asyncio.sleep(0.05)
    await engine.pause("wait")   # returns once the request has finished on the server
    assert (await asyncio.wait_for(running, 5))[-1].finish_reason is FinishReason.LENGTH
    assert engine.state is EngineState.PAUSED
    with pytest.raises(EngineUnavailable, match="paused"):
        await drain(engine.generate(req("x")))
    await engine.resume()
    await drain(engine.generate(req("y", max_tokens=3)))
    aborted = asyncio.ensure_future(drain(engine.generate(req("z", max_tokens=60))))
    await asyncio.sleep(0.1)
    await engine.pause("abort")
    assert (await asyncio.wait_for(aborted, 5))[-1].finish_reason is FinishReason.ABORTED


async def test_flush_cache_is_sglangs_and_refused_while_requests_hold_the_cache(make):
    engine, server = await make("--fake-token-delay", "0.05")
    await engine.flush_cache()
    assert server.state()["calls"].count("/flush_cache") == 1
    running = asyncio.ensure_future(drain(engine.generate(req("h", max_tokens=30))))
    await wait_until(lambda: server.state()["running"], 10, what="a running request")
    with pytest.raises(CacheInUse, match="pending requests"):
        await engine.flush_cache()
    assert (await asyncio.wait_for(running, 10))[-1].finish_reason is FinishReason.LENGTH
    await engine.flush_cache()


# ---------------------------------------------------------------- memory
async def test_sleep_levels_and_wake_up(make, model_dir):
    engine, server = await make()
    with pytest.raises(InvalidRequest, match="enable-weights-cpu-backup"):
        await engine.sleep(1)
    assert engine.state is EngineState.ACTIVE   # refused: nothing changed
    freed = await engine.sleep(2)
    assert freed == sum(a * b * 4 for a, b in SHAPES.values())
    assert engine.state is EngineState.SLEEPING and server.state()["released"] == ["cuda_graph", "kv_cache",
                                                                                   "weights"]
    with pytest.raises(EngineUnavailable, match="asleep"):
        await drain(engine.generate(req()))
    await engine.wake_up({"weights"})
    assert server.state()["released"] == ["cuda_graph", "kv_cache"]
    await engine.wake_up()
    assert engine.state is EngineState.AWAITING_WEIGHTS and server.state()["released"] == []
    with pytest.raises(WeightMismatch, match="complete set"):
        await engine.load_weights({"lm_head.weight": torch.zeros(32, 8)}, 1)
    weights = {n: torch.full(s, 0.001) for n, s in SHAPES.items()}
    await engine.load_weights(weights, 1)
    assert engine.state is EngineState.ACTIVE and engine.weight_version == 1
    chunks = await drain(engine.generate(req(max_tokens=4)))
    assert tokens(chunks) == expected_tokens([1, 2, 3], 4, 0.001 * 256)


async def test_level_one_sleep_with_the_servers_host_backup(make):
    engine, server = await make("--enable-weights-cpu-backup", weights_cpu_backup=True)
    before = server.state()["weight_sum"]
    await engine.sleep(1)
    await engine.wake_up()
    assert engine.state is EngineState.ACTIVE and server.state()["weight_sum"] == before


# ---------------------------------------------------------------- weights
async def test_weight_update_broadcasts_over_the_update_group(make):
    engine, server = await make("--fake-token-delay", "0.03")
    in_flight = asyncio.ensure_future(drain(engine.generate(req("f", max_tokens=120))))   # ~3.6 s: still running
    await wait_until(lambda: server.state()["running"] == ["f"], 10, what="the request to start")
    await asyncio.sleep(0.1)
    weights = {n: torch.full(s, 0.002) for n, s in SHAPES.items()}
    await engine.load_weights(weights, 3)
    chunks = await in_flight
    state = server.state()
    assert state["pause_modes"] == ["retract"] and state["flush_refused"] == 0
    assert state["group"]["world_size"] == 2 and state["group"]["rank_offset"] == 1
    assert state["weight_sum"] == pytest.approx(0.002 * 256)
    versions = [s.weight_version for s in chunks[-1].segments]
    assert versions[0] == 0 and versions[-1] == 3 and len(tokens(chunks)) == 120
    assert dict(engine.named_weights())["lm_head.weight"] is weights["lm_head.weight"]
    await engine.load_weights({"lm_head.weight": torch.full((32, 8), 0.003)}, 4)   # the group is reused
    assert server.state()["updates"] == 2 and "/continue_generation" not in server.state()["calls"][-1:]


async def test_mismatched_weights_send_nothing(make):
    engine, server = await make()
    with pytest.raises(WeightMismatch, match="shape"):
        await engine.load_weights({"lm_head.weight": torch.zeros(3, 3)}, 1)
    with pytest.raises(WeightMismatch, match="unknown weight"):
        await engine.load_weights({"nope": torch.zeros(3)}, 1)
    assert "/init_weights_update_group" not in server.state()["calls"] and engine.weight_version == 0


async def test_load_snapshot_reads_the_servers_metrics(make):
    engine, server = await make("--fake-token-delay", "0.01")
    await asyncio.gather(*(drain(engine.generate(req(f"m{i}", max_tokens=6))) for i in range(4)))
    await wait_until(lambda: engine.load_snapshot().ttft_p95_s > 0, 10, what="the TTFT histogram to be read")
    snapshot = engine.load_snapshot()
    assert snapshot.max_total_tokens == 64 and snapshot.tokens_per_second > 0


# ------------------------------------------------------------- launch / death
async def test_launched_server_is_started_and_stopped_with_the_engine(model_dir):
    engine = create_engine("sglang", model_path=str(model_dir), server_command=FAKE, weight_backend="gloo",
                           server_args=["--fake-startup-delay", "0.5"], stream_interval=4)
    await engine.start()
    try:
        process = engine._process
        assert process is not None and process.poll() is None
        chunks = await drain(engine.generate(req(max_tokens=3)))
        assert len(tokens(chunks)) == 3
    finally:
        await engine.close()
    assert process.poll() is not None


async def test_a_server_that_goes_away_kills_the_engine(make):
    engine, server = await make("--fake-token-delay", "0.05")
    stream = asyncio.ensure_future(drain(engine.generate(req("d", max_tokens=100))))
    await asyncio.sleep(0.2)
    server.stop()
    with pytest.raises(EngineDead):
        await stream
    await wait_until(lambda: engine.state is EngineState.DEAD, 10, what="the engine to be DEAD")


async def test_attaching_to_nothing_fails_to_start(model_dir):
    engine = create_engine("sglang", model_path=str(model_dir), url=f"http://127.0.0.1:{free_port()}",
                           startup_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(EngineDead, match="not healthy"):
        await engine.start()
    assert time.monotonic() - started < 10
