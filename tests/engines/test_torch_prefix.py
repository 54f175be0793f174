"""The torch engine's prefix cache: what it keeps and finds, and that reuse never changes an output."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replica_agent.engines import create_engine
from replica_agent.engines.torch_prefix import PrefixCache
from replica_agent.engines.types import EngineRequest, SamplingParams


def kv(n: int, fill: float = 1.0):
    return [torch.full((2, n, 4), fill)], [torch.full((2, n, 4), -fill)]


def test_lookup_finds_the_longest_block_aligned_prefix_and_leaves_a_token_to_prefill():
    clock = [0.0]
    cache = PrefixCache(64, block=4, idle_s=10, clock=lambda: clock[0])
    cache.insert(list(range(10)), *kv(10))            # keeps 8 tokens (two blocks)
    assert cache.tokens == 8
    entry, length = cache.lookup(list(range(20)))
    assert length == 8 and entry.tokens == tuple(range(8)) and entry.keys[0].shape == (2, 8, 4)
    assert cache.lookup(list(range(8)))[1] == 4          # a whole match still prefills its last token
    assert cache.lookup([0, 1, 2, 3, 9, 9, 9, 9, 9])[1] == 4
    assert cache.lookup([5, 5, 5, 5, 5])[0] is None
    assert (cache.stats.lookups, cache.stats.hits, cache.stats.hit_tokens) == (4, 3, 16)


def test_capacity_expiry_and_sessions():
    clock = [0.0]
    cache = PrefixCache(16, block=4, idle_s=10, clock=lambda: clock[0])
    cache.insert([1] * 8, *kv(8), session="s1")
    cache.insert([2] * 8, *kv(8), session="s2")
    cache.lookup([1] * 9)                               # touch s1: s2 is now the least recently used
    cache.insert([3] * 8, *kv(8))
    assert cache.tokens == 16 and cache.lookup([2] * 9)[0] is None and cache.stats.evicted == 1
    assert cache.close_session("s1") and not cache.close_session("s1") and cache.lookup([1] * 9)[0] is None
    clock[0] = 11.0
    assert cache.lookup([3] * 9)[0] is None and cache.stats.expired == 1 and cache.tokens == 0
    cache.insert([4] * 8, *kv(8))
    cache.insert([4] * 8, *kv(8, 2.0))                  # the same tokens again: kept once
    assert len(cache) == 1
    with pytest.raises(ValueError):
        PrefixCache(2, block=4)


async def _gen(engine, rid, prompt, n, session=""):
    ids, lps = [], []
    async for chunk in engine.generate(EngineRequest(rid, prompt, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True, logprobs=True), session_id=session)):
        ids += chunk.token_ids
        lps += chunk.logprobs
    return ids, lps


async def _workload(engine):
    prompt = list(range(10, 110))
    group = await asyncio.gather(*(_gen(engine, f"g{i}", prompt, 12) for i in range(4)))   # a GRPO group
    later = await _gen(engine, "later", prompt + [7, 7, 7], 12)
    turn1 = await _gen(engine, "t1", prompt, 24, "traj")
    await asyncio.sleep(0.05)   # the engine retires the finished row, keeping its sequence
    turn2 = await _gen(engine, "t2", prompt + turn1[0] + [9, 9, 9], 24, "traj")
    return group, later, turn1, turn2


def test_reuse_gives_the_same_tokens_and_logprobs_and_counts_its_hits():
    async def run(tokens: int):
        engine = create_engine("torch", preset="tiny-llama", seed=5, prefix_cache_tokens=tokens, num_threads=1)
        await engine.start()
        try:
            out = await _workload(engine)
            return out, engine.prefix_stats(), await engine.close_session("traj")
        finally:
            await engine.close()

    (plain, none, _), (cached, stats, closed) = asyncio.run(run(0)), asyncio.run(run(8192))
    assert none is None
    for a, b in zip(plain, cached):
        a_list, b_list = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
        for (ids_a, lps_a), (ids_b, lps_b) in zip(a_list, b_list):
            assert ids_a == ids_b
            assert lps_a == pytest.approx(lps_b, abs=1e-4)
    # the group's prompt was prefilled once; the later prompt, turn 1 and turn 2 reused cached tokens
    assert stats.hits == 3 and stats.hit_tokens == 96 + 96 + 112
    assert closed   # the trajectory's cached turns were dropped at CloseSession


def test_new_weights_empty_the_cache():
    async def run():
        engine = create_engine("torch", preset="tiny-llama", seed=5, prefix_cache_tokens=4096, num_threads=1)
        await engine.start()
        try:
            await _gen(engine, "a", list(range(10, 60)), 4)
            assert len(engine._runner.prefix) > 0
            await engine.load_weights(dict(engine.named_weights()), version=1)
            assert len(engine._runner.prefix) == 0
        finally:
            await engine.close()

    asyncio.run(run())


def test_kv_of_older_weights_is_never_kept():
    cache = PrefixCache(64, block=4)
    generation = cache.generation
    cache.clear()                                        # a weight swap while a row was running
    cache.insert(list(range(8)), *kv(8), generation=generation)
    assert len(cache) == 0
    cache.insert(list(range(8)), *kv(8), generation=cache.generation)
    assert len(cache) == 1


def test_results_report_the_cached_tokens_of_their_context():
    async def final_usage(engine, rid, prompt):
        async for chunk in engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=3,
                                                                                         ignore_eos=True))):
            usage = chunk.usage
        return usage

    async def run():
        engine = create_engine("torch", preset="tiny-llama", seed=5, prefix_cache_tokens=4096, num_threads=1)
        await engine.start()
        try:
            prompt = list(range(10, 110))
            first = await final_usage(engine, "a", prompt)
            second = await final_usage(engine, "b", prompt + [7, 7])
            return first.cached_tokens, second.cached_tokens
        finally:
            await engine.close()

    assert asyncio.run(run()) == (0, 96)   # 6 whole blocks of 16 of the first prompt


def test_a_held_sequence_outlives_idle_ones_until_used_expired_or_all_are_held():
    """Eviction passes over held entries while one nobody holds remains; a lookup that uses a held entry ends its
    hold; a hold past its deadline is evictable again; with every entry held, the one ending soonest goes."""
    clock = [0.0]
    cache = PrefixCache(24, block=4, idle_s=100, clock=lambda: clock[0])
    cache.insert([1] * 8, *kv(8), session="s1", hold_s=10)
    cache.insert([2] * 8, *kv(8))
    cache.insert([3] * 8, *kv(8))
    cache.insert([4] * 8, *kv(8))                       # full: [2] goes, not the older but held [1]
    assert cache.lookup([2] * 9)[0] is None and cache.lookup([1] * 9)[1] == 8
    assert cache.stats.holds_used == 1                  # that lookup was the session coming back: hold over
    cache.insert([1] * 12, *kv(12), session="s1", hold_s=10)   # its next turn, held again; [3] and [4] make room
    assert cache.lookup([3] * 9)[0] is None and cache.lookup([1] * 13)[1] == 12
    clock[0] = 20.0
    cache.insert([5] * 8, *kv(8), hold_s=5)             # the unheld [1] entries make room for these two
    cache.insert([6] * 8, *kv(8), hold_s=50)
    cache.insert([7] * 8, *kv(8), hold_s=30)
    assert cache.stats.holds_evicted == 0 and cache.lookup([1] * 9)[0] is None
    cache.insert([8] * 8, *kv(8), hold_s=40)             # every entry is held: [5] ends soonest and goes
    assert cache.stats.holds_evicted == 1 and cache.lookup([5] * 9)[0] is None
    assert cache.lookup([6] * 9)[1] == 8 and cache.stats.held == 6
    clock[0] = 100.0                                     # past every deadline: plain LRU again
    cache.insert([9] * 8, *kv(8))
    assert cache.stats.holds_evicted == 1 and cache.lookup([7] * 9)[0] is None


def test_the_torch_engine_holds_a_session_turn_that_finished_and_not_one_aborted():
    async def run():
        engine = create_engine("torch", preset="tiny-llama", seed=5, prefix_cache_tokens=4096, num_threads=1)
        await engine.start()
        try:
            prompt = list(range(10, 110))
            async for _ in engine.generate(EngineRequest("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                                         session_id="traj", hold_kv_s=30.0)):
                pass
            stream = engine.generate(EngineRequest("b", list(range(130, 230)),
                                                   SamplingParams(max_tokens=300, ignore_eos=True),
                                                   session_id="other", hold_kv_s=30.0))
            await stream.__anext__()
            assert await engine.abort(["b"]) == ["b"]
            async for _ in stream:
                pass
            async for chunk in engine.generate(EngineRequest("c", prompt + [7, 7], SamplingParams(max_tokens=2),
                                                             session_id="traj")):
                usage = chunk.usage
            return engine._runner.prefix.stats, usage.cached_tokens
        finally:
            await engine.close()

    stats, cached = asyncio.run(run())
    assert stats.held == 1 and stats.holds_used == 1 and cached == 96   # a's hold, used by its session's next turn
