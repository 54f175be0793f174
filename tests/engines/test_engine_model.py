"""The engine model: prefix cache, KV admission and step costs, alone and inside the synthetic engine."""

from __future__ import annotations

import asyncio

import pytest

from mesh_runtime.prefix import block_keys
from replica_agent.engines.engine_model import EngineModel, EngineModelConfig
from replica_agent.engines.errors import InvalidRequest
from replica_agent.engines.synthetic import SyntheticEngine, SyntheticEngineConfig, VirtualClock
from replica_agent.engines.types import EngineRequest, FinishReason, SamplingParams


def model(**kw) -> EngineModel:
    return EngineModel(EngineModelConfig(block_size=4, **kw))


def test_siblings_share_a_prompt_and_a_next_turn_reuses_the_whole_sequence():
    m = model()
    prompt = list(range(100, 110))                     # 2 whole blocks and 2 tokens
    assert m.admit("a", prompt, 8) == 0
    assert m.admit("b", prompt, 8) == 8                # its siblings find both blocks
    assert m.admit("c", prompt[:8], 8) == 4            # a whole match still computes its last token
    m.step_seconds([("a", 4), ("b", 4), ("c", 4)])
    m.release("a", prompt + [1, 2, 3, 4, 5, 6])        # 16 tokens: 4 blocks kept
    assert m.cache_tokens == 16
    assert m.admit("turn2", prompt + [1, 2, 3, 4, 5, 6, 9, 9], 8) == 16
    assert m.prompt_tokens == 10 + 10 + 8 + 18 and m.cached_tokens == 8 + 4 + 16
    assert m.hit_rate == pytest.approx(28 / 46)


def test_idle_blocks_are_evicted_least_recently_used_tail_first():
    m = model(kv_capacity_tokens=48)                   # 12 blocks
    m.admit("a", list(range(12)), 4)                   # 3 prompt blocks + 1 reserved
    m.release("a", list(range(16)))                    # 4 idle blocks
    m.admit("b", list(range(50, 62)), 4)
    m.release("b", list(range(50, 66)))                # 8 idle blocks, a's the least recently used
    m.admit("c", list(range(200, 212)), 8)             # needs 3 + 2: evicts one, a's last block
    assert m.blocks.evicted == 1
    assert m.admit("a2", list(range(16)) + [1], 1) == 12   # a's first three blocks are left
    assert m.blocks.evicted == 3                       # room for a2's 2 blocks: b's last two went
    assert m.admit("b2", list(range(50, 66)) + [1], 1) is None   # KV is full
    m.release("c")
    assert m.admit("b2", list(range(50, 66)) + [1], 1) == 8     # c's idle blocks make room


def test_a_request_waits_until_kv_is_free_and_prefill_has_a_budget_per_step():
    m = model(kv_capacity_tokens=40)
    assert m.admit("a", list(range(20)), 16) == 0      # 5 + 4 blocks of 10
    assert m.admit("b", list(range(500, 508)), 4) is None
    assert m.used_tokens == 36
    m.release("a")
    assert m.admit("b", list(range(500, 508)), 4) == 0
    budget = model(max_prefill_tokens=10)
    assert budget.admit("x", list(range(8)), 1) == 0
    assert budget.admit("y", list(range(30, 38)), 1) is None   # past this step's prefill budget
    budget.step_seconds([("x", 1)])
    assert budget.admit("y", list(range(30, 38)), 1) == 0


def test_step_cost_grows_with_batch_context_and_uncached_prompt():
    c = EngineModelConfig(decode_step_s=0.005, decode_per_seq_s=0.001, decode_per_context_token_s=1e-6,
                          prefill_tokens_per_s=1000.0, block_size=4)
    m = EngineModel(c)
    m.admit("a", list(range(100)), 10)
    m.admit("b", list(range(100)), 10)                 # 96 cached: 4 tokens to compute
    first = m.step_seconds([("a", 2), ("b", 2)])
    assert first == pytest.approx(2 * (0.005 + 2 * 0.001) + 1e-6 * (2 * 200 + 2 * 1) + 104 / 1000)
    second = m.step_seconds([("a", 2), ("b", 2)])      # contexts grew by 2 each; no prefill
    assert second == pytest.approx(2 * (0.005 + 2 * 0.001) + 1e-6 * (2 * 204 + 2 * 1))
    half = EngineModel(EngineModelConfig(speed=0.5, block_size=4))
    half.admit("a", [1, 2, 3], 4)
    full = EngineModel(EngineModelConfig(block_size=4))
    full.admit("a", [1, 2, 3], 4)
    assert half.step_seconds([("a", 3)]) == pytest.approx(2 * full.step_seconds([("a", 3)]))


def test_new_weights_make_cached_blocks_unusable():
    m = model()
    prompt = list(range(20))
    m.admit("old", prompt, 4)
    m.release("done", prompt)                          # unknown request: nothing happens
    m.clear()                                          # new weights while "old" runs
    assert m.admit("new", prompt, 4) == 0
    m.release("old", prompt + [1, 2, 3, 4])            # its blocks are of the old weights: not kept
    assert m.admit("newer", prompt, 4) == 16           # "new"'s blocks are the ones found


def test_bad_options_are_refused():
    for bad in ({"speed": 0}, {"block_size": 0}, {"kv_capacity_tokens": 8, "block_size": 16},
                {"decode_step_s": -1}):
        with pytest.raises(InvalidRequest):
            EngineModel(EngineModelConfig(**bad))
    with pytest.raises(InvalidRequest, match="both set"):
        SyntheticEngine(SyntheticEngineConfig(engine_model={}, tokens_per_second=100))
    with pytest.raises(InvalidRequest, match="unknown engine_model option"):
        SyntheticEngineConfig(engine_model={"sped": 1})


def test_the_synthetic_engine_runs_on_the_model():
    async def run():
        clock = VirtualClock()
        engine = SyntheticEngine(SyntheticEngineConfig(engine_model={"block_size": 16},
                                                       lengths={"kind": "fixed", "value": 64}),
                                 clock=clock, sleep=clock.sleep)
        await engine.start()
        prompt = list(range(2, 1002))

        async def one(rid, context):
            async for chunk in engine.generate(EngineRequest(rid, context, SamplingParams(max_tokens=32))):
                last = chunk
            return last

        group = await asyncio.gather(*(one(f"g{i}", prompt) for i in range(4)))
        took = clock()
        follow = await one("next", prompt + group[0].token_ids + [5, 6, 7])
        snapshot = engine.load_snapshot()
        await engine.close()
        return group, follow, took, snapshot

    group, follow, took, snapshot = asyncio.run(run())
    assert [g.usage.cached_tokens for g in group] == [0, 992, 992, 992]
    assert follow.usage.cached_tokens == 992     # the prompt's blocks; the reply's 32 tokens end in no full block
    # one prefill of ~1,024 tokens at 30,000/s plus 32 decode iterations of ~6.3 ms
    assert 0.2 < took < 0.3
    assert snapshot.max_total_tokens == 400_000 and snapshot.prefix_cache_tokens >= 992
    assert 0 < snapshot.prefix_cache_hit_rate < 1


def test_the_cache_publishes_what_it_stores_and_removes_and_a_reset_on_new_weights():
    m = model(kv_capacity_tokens=32)                   # 8 blocks
    queue: asyncio.Queue = asyncio.Queue()
    m.admit("a", list(range(12)), 4)                   # stored before anyone watched: in the snapshot
    m.events.subscribe(queue, "r0")
    tag, reset, snapshot, removed = queue.get_nowait()
    assert (tag, reset, removed) == ("r0", True, []) and snapshot == block_keys(list(range(12)), 4)
    m.release("a", list(range(16)))                    # its generated block is kept too
    assert queue.get_nowait()[1:] == (False, block_keys(list(range(16)), 4)[3:], [])
    m.admit("b", list(range(100, 124)), 8)             # 6 blocks + 2 reserved: evicts a's 4 blocks
    _, reset, stored, removed = queue.get_nowait()
    assert not reset and len(stored) == 6 and len(removed) == 4
    m.clear()
    assert queue.get_nowait()[1:] == (True, [], [])
    m.release("b", list(range(100, 130)))              # blocks of the old weights are dropped, not kept
    assert m.cache_tokens == 0
    m.events.unsubscribe(queue)
    m.admit("c", list(range(8)), 1)
    assert queue.empty()


def test_a_held_session_keeps_its_blocks_over_idle_ones_until_it_comes_back_expires_or_pressure():
    """A turn that ends in a tool call holds its sequence: admissions evict every idle block first; the session's
    next request ends the hold; a hold ends at its deadline; under pressure the soonest-ending hold goes."""
    now = [0.0]
    m = EngineModel(EngineModelConfig(block_size=4, kv_capacity_tokens=48), clock=lambda: now[0])   # 12 blocks
    m.admit("t1", list(range(12)), 4, session="traj")
    m.release("t1", list(range(16)), session="traj", hold_s=10.0)   # 4 blocks held
    m.admit("x", list(range(100, 112)), 4)
    m.release("x", list(range(100, 116)))                           # 4 idle blocks, more recent than traj's
    assert m.held_sessions == 1 and m.hold_stats.held == 1
    assert m.used_tokens == 0                                       # held, not used: given up under pressure
    m.admit("y", list(range(200, 220)), 8)                          # 5 + 2 blocks: x's go, traj's stay
    assert m.blocks.matched(block_keys(list(range(16)), 4)) == 4 and m.blocks.matched(block_keys(list(range(100, 116)), 4)) < 4
    m.release("y")
    assert m.admit("t2", list(range(16)) + [7, 7], 4, session="traj") == 16   # the session came back: all cached
    assert m.held_sessions == 0 and m.hold_stats.used == 1
    m.release("t2", list(range(16)) + [7, 7], session="traj", hold_s=10.0)
    now[0] = 11.0                                                   # past the deadline: unpinned at the next admit
    m.admit("z", [1, 2], 1)
    assert m.held_sessions == 0 and m.hold_stats.expired == 1
    m.release("z")

    # pressure: two holds fill the cache; an admission that needs room ends the one that would expire soonest
    p = EngineModel(EngineModelConfig(block_size=4, kv_capacity_tokens=40), clock=lambda: 0.0)      # 10 blocks
    for session, base, hold in (("a", 0, 5.0), ("b", 100, 50.0)):
        p.admit(session, list(range(base, base + 16)), 1, session=session)
        p.release(session, list(range(base, base + 16)), session=session, hold_s=hold)
    assert len(p.blocks.idle) == 0 and p.held_sessions == 2 and p.hold_stats.released == 0
    assert p.admit("c", list(range(300, 312)), 4) == 0              # 3 + 1 blocks: a's hold is given up
    assert p.hold_stats.released == 1 and p.held_sessions == 1
    assert p.blocks.matched(block_keys(list(range(100, 116)), 4)) == 4        # b's, ending later, stay
    assert p.close_session("b") and not p.close_session("b") and p.held_sessions == 0
    # new weights end every hold
    p.release("c")
    p.admit("d", list(range(16)), 1, session="d")
    p.release("d", list(range(16)), session="d", hold_s=5.0)
    p.clear()
    assert p.held_sessions == 0 and len(p.blocks) == 0


def test_the_synthetic_engine_holds_a_finished_turn_and_not_an_aborted_one():
    clock = VirtualClock()
    config = SyntheticEngineConfig(engine_model=EngineModelConfig(block_size=4, kv_capacity_tokens=4096),
                                   tokens_per_step=4, vocab_size=1000)
    engine = SyntheticEngine(config, clock=clock, sleep=clock.sleep)

    async def run() -> None:
        await engine.start()
        try:
            request = EngineRequest("t1", list(range(10, 30)), SamplingParams(max_tokens=8, ignore_eos=True),
                                    session_id="traj", hold_kv_s=30.0)
            async for _ in engine.generate(request):
                pass
            assert engine.model.held_sessions == 1
            assert await engine.close_session("traj") and engine.model.held_sessions == 0
            request = EngineRequest("t2", list(range(10, 30)), SamplingParams(max_tokens=4000, ignore_eos=True),
                                    session_id="other", hold_kv_s=30.0)
            stream = engine.generate(request)
            await stream.__anext__()
            assert await engine.abort(["t2"]) == ["t2"]
            async for last in stream:
                pass
            assert last.finish_reason is FinishReason.ABORTED and engine.model.held_sessions == 0     # aborted: resumed elsewhere, not continued here
        finally:
            await engine.close()

    asyncio.run(run())


def test_with_preemption_kv_is_allocated_as_tokens_come_and_the_newest_request_gives_way():
    reserving = EngineModel(EngineModelConfig(block_size=4, kv_capacity_tokens=40), iterations_per_step=4)
    assert reserving.admit("a", list(range(8)), 32) == 0
    assert reserving.admit("b", list(range(50, 58)), 32) is None      # a reserved all 32 tokens' blocks
    assert reserving.grow([("a", 4)], lambda _: []) == []

    m = EngineModel(EngineModelConfig(block_size=4, kv_capacity_tokens=40, preempt=True), iterations_per_step=4)
    a, b = list(range(8)), list(range(50, 58))
    assert m.admit("a", a, 32) == 0 and m.admit("b", b, 32) == 0     # 2 prompt blocks + 1 for a step each
    assert m.used_tokens == 24
    sequences = {"a": list(a), "b": list(b)}

    def step() -> list[str]:
        """Both decode 4 tokens; then the model finds blocks for their next 4."""
        m.step_seconds([("a", 4), ("b", 4)])
        for rid, sequence in sequences.items():
            sequence += [7 if rid == "a" else 9] * 4
        return m.grow([("a", 4), ("b", 4)], sequences.__getitem__)

    assert step() == [] and step() == []                               # a block more per step, 10 in all
    assert m.used_tokens == 40
    assert step() == ["b"]                                              # the newest gives way
    assert m.preemptions == 1 and m.used_tokens == 24                   # a's 2 + 4 blocks
    # b's 5 full blocks were cached; a's growth evicted its last: b comes back to 4 of them
    assert m.admit("b", sequences["b"], 20) is None                     # but waits for room
    m.release("a", sequences["a"])
    assert m.admit("b", sequences["b"], 20) == 16


def test_with_preemption_holds_give_way_before_a_running_request():
    m = EngineModel(EngineModelConfig(block_size=4, kv_capacity_tokens=32, preempt=True), iterations_per_step=4,
                    clock=lambda: 0.0)
    m.admit("t1", list(range(8)), 4)
    m.release("t1", list(range(8)) + [5] * 4, session="s", hold_s=60)  # 3 blocks held for the next turn
    assert m.admit("a", list(range(100, 116)), 64) == 0                # 4 + 1
    sequence = list(range(100, 116))
    for _ in range(3):                                                 # to 8 blocks: the hold goes
        m.step_seconds([("a", 4)])
        sequence += [3] * 4
        assert m.grow([("a", 4)], lambda _: sequence) == []
    assert m.hold_stats.released == 1 and m.preemptions == 0
    assert m.held_sessions == 0
    m.step_seconds([("a", 4)])
    sequence += [3] * 4
    assert m.grow([("a", 4)], lambda _: sequence) == ["a"]            # alone and out of room: itself
    assert m.used_tokens == 0 and m.cache_tokens == 32                 # its 8 full blocks stay cached


def test_preempted_requests_finish_with_the_tokens_an_unpressed_engine_gives():
    def run(capacity):
        async def go():
            clock = VirtualClock()
            engine = SyntheticEngine(SyntheticEngineConfig(
                engine_model={"block_size": 16, "kv_capacity_tokens": capacity, "preempt": True},
                lengths={"kind": "fixed", "value": 150}), clock=clock, sleep=clock.sleep)
            await engine.start()

            async def one(rid):
                prompt = [2 + i for i in range(100)] + [int(rid[1:]) + 3]
                tokens = []
                async for chunk in engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=200))):
                    tokens += chunk.token_ids
                return tokens, chunk.finish_reason, chunk.usage.cached_tokens

            out = await asyncio.gather(*(one(f"r{i}") for i in range(6)))
            preempted = engine.model.preemptions
            left = dict(engine._preempted)
            # each came back with the tokens it had generated as context, not with its prompt alone
            assert engine.model.prompt_tokens > 101 * (6 + preempted) or not preempted
            await engine.close()
            return out, preempted, left

        return asyncio.run(go())

    ample, none_preempted, _ = run(400_000)
    tight, preempted, left = run(640)                   # 40 blocks: six requests of 16-17 blocks each
    assert none_preempted == 0 and preempted > 0 and left == {}
    assert tight == ample
    assert all(len(tokens) == 150 and reason == FinishReason.STOP for tokens, reason, _ in tight)
    assert [cached for *_, cached in tight] == [0] + [96] * 5   # the prompt's shared blocks, as first found


def test_a_preempted_request_aborted_while_it_waits_leaves_nothing_behind():
    async def go():
        clock = VirtualClock()
        engine = SyntheticEngine(SyntheticEngineConfig(
            engine_model={"block_size": 16, "kv_capacity_tokens": 320, "preempt": True},
            lengths={"kind": "fixed", "value": 200}), clock=clock, sleep=clock.sleep)
        await engine.start()

        async def one(rid):
            prompt = [rid] * 60
            async for chunk in engine.generate(EngineRequest(f"r{rid}", prompt, SamplingParams(max_tokens=250))):
                pass
            return chunk.finish_reason

        tasks = [asyncio.ensure_future(one(i + 2)) for i in range(3)]
        while not engine._preempted:
            await asyncio.sleep(0)
        victim = next(iter(engine._preempted))
        assert victim in [a.request_id for a in engine._waiting]
        await engine.abort([victim])
        reasons = await asyncio.gather(*tasks)
        left = dict(engine._preempted)
        await engine.close()
        return victim, reasons, left

    victim, reasons, left = asyncio.run(go())
    assert left == {}
    assert reasons[int(victim[1:]) - 2] == FinishReason.ABORTED
    assert sorted(reasons, key=str).count(FinishReason.STOP) == 2


def test_preempt_must_be_a_bool():
    with pytest.raises(InvalidRequest, match="preempt must be true or false"):
        EngineModel(EngineModelConfig(preempt="yes"))
