"""Rollouter: groups, staleness budget, replica-driven concurrency, history, failures, checkpoints."""

from __future__ import annotations

import asyncio
import json

import pytest

from trainer_agent.driver import (
    MessageQueue,
    Prompt,
    RolloutConfig,
    RolloutFailed,
    Rollouter,
    rollout_resource_utilization,
)
from trainer_agent.driver.rollouter import STEP_GENERATED_METRIC, UTILIZATION_METRIC
from tests.trainer_agent.driver.fakes import FakeGenerate, ManualClock, until

pytestmark = pytest.mark.timeout(60)


def prompts(count: int, start: int = 0) -> list[Prompt]:
    return [Prompt(f"p{i}", [i, i + 1]) for i in range(start, start + count)]


class Replicas:
    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self) -> int:
        return self.count


def make(
    *,
    n: int = 2,
    mini: int = 1,
    trigger: int = 2,
    staleness: float = 0.5,
    per_replica: int = 4,
    replicas: int = 10,
    max_queue: int = 100,
    data: list[Prompt] | None = None,
    max_retries: int = 2,
    partial_rollout: bool = True,
) -> tuple[Rollouter, MessageQueue, FakeGenerate, Replicas, ManualClock]:
    clock = ManualClock()
    cfg = RolloutConfig(
        n=n,
        ppo_mini_batch_size=mini,
        trigger_parameter_sync_step=trigger,
        staleness_threshold=staleness,
        concurrent_samples_per_replica=per_replica,
        max_retries=max_retries,
        partial_rollout=partial_rollout,
    )
    q = MessageQueue(max_queue, clock=clock)
    gen = FakeGenerate()
    reps = Replicas(replicas)
    r = Rollouter(cfg, q, gen, data if data is not None else prompts(20), reps, clock=clock,
                  capacity_poll_interval=None)
    return r, q, gen, reps, clock


async def drain(r: Rollouter, gen: FakeGenerate, q: MessageQueue) -> None:
    """Complete requests until the rollouter has nothing more in flight."""
    await until(lambda: gen.in_flight == r.active_tasks)
    while gen.in_flight:
        gen.complete_all()
        await until(lambda: gen.in_flight == r.active_tasks)


def test_config_sample_arithmetic_is_verls_in_prompts() -> None:
    cfg = RolloutConfig(n=4, ppo_mini_batch_size=8, require_batches=2, trigger_parameter_sync_step=4,
                        staleness_threshold=0.1)
    assert cfg.required_samples == 16                     # ppo_mini_batch_size x require_batches, prompts
    assert cfg.step_required_samples == 64
    assert cfg.buffer_samples == pytest.approx(6.4)       # 64 x 0.1, a float, not floored
    assert cfg.max_required_samples == 70                 # int(16 x 1.1 x 4) = int(70.4)
    assert (cfg.required_completions, cfg.max_required_completions) == (64, 280)   # x n responses


async def test_groups_enter_the_queue_as_a_unit_with_request_fields() -> None:
    r, q, gen, _, _ = make(n=3, data=prompts(1), partial_rollout=False)
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 3)
    assert all(c.partial_rollout is False for c in gen.calls)
    assert {c.session_id for c in gen.calls} == {"p0#0"}
    assert sorted(c.request_id for c in gen.calls) == ["p0#0/0", "p0#0/1", "p0#0/2"]
    gen.complete("p0#0/2", version=5)
    gen.complete("p0#0/0", version=5)
    await until(lambda: r.active_tasks == 1)
    assert q.size() == 0  # two of three done: nothing queued yet
    gen.complete("p0#0/1", tokens=[9], version=6)
    stats = await run
    assert stats["groups_enqueued"] == 1 and q.closed
    batch = await q.get_batch(3, timeout=0)
    assert [s.index for s in batch.samples] == [0, 1, 2]
    assert batch.samples[1].completion_ids == [9] and batch.samples[1].weight_versions == [6]
    assert batch.samples[0].param_version == 0 and batch.samples[0].logprobs == [-0.5, -0.5]
    assert batch.end_of_data


async def test_staleness_pause_and_resume_on_reset() -> None:
    # required=1 prompt, step_required=2, max_required=int(1 x 1.5 x 2)=3 groups = 6 completions per window.
    r, q, gen, _, _ = make(n=2, mini=1, trigger=2, staleness=0.5)
    assert r.config.max_required_samples == 3 and r.config.max_required_completions == 6
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 6)
    await drain(r, gen, q)
    await until(lambda: r.paused == "staleness")
    assert len(gen.calls) == 6
    # Completions while paused are recorded as drains.
    assert [p.kind for p in r.history].count("drain") == 6
    assert q.size() == 6 and r.step_generated_samples == 3     # groups, as verl counts samples

    # Consume everything, then reset: a fresh budget of 6 at version 1.
    await q.get_batch(6, timeout=0)
    metrics = r.reset_staleness(1)
    assert metrics[STEP_GENERATED_METRIC] == 3
    assert r.step_generated_samples == 0
    await until(lambda: gen.in_flight == 6)
    assert {c.param_version for c in gen.calls[6:]} == {1}
    await drain(r, gen, q)
    await until(lambda: r.paused == "staleness" and q.size() == 6)
    assert len(gen.calls) == 12

    # Reset with 4 samples still queued: they count against the new window,
    # so only one more group (2 samples) is admitted.
    await q.get_batch(2, timeout=0)
    r.reset_staleness(2)
    assert r.staleness_samples == 4
    await until(lambda: gen.in_flight == 2)
    await drain(r, gen, q)
    await until(lambda: r.paused == "staleness" and q.size() == 6)
    assert len(gen.calls) == 14
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_pauses_when_queue_is_full_and_resumes_on_consumption() -> None:
    r, q, gen, _, _ = make(n=2, trigger=10, staleness=1.0, max_queue=4, per_replica=1, replicas=2)
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 2)
    gen.complete_all()
    await until(lambda: gen.in_flight == 2)
    gen.complete_all()
    await until(lambda: q.size() == 4 and r.paused == "queue_full")
    assert gen.in_flight == 0 and len(gen.calls) == 4
    await q.get_batch(2, timeout=0)
    await until(lambda: gen.in_flight == 2)
    assert len(gen.calls) == 6
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_concurrency_follows_active_replicas_and_history_records_capacity() -> None:
    r, q, gen, reps, clock = make(n=1, trigger=50, staleness=0.0, per_replica=2, replicas=1, data=prompts(30))
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 2)
    await asyncio.sleep(0)
    assert gen.in_flight == 2 and r.capacity == 2

    clock.advance(1)
    reps.count = 3
    r.notify_capacity_changed()
    await until(lambda: gen.in_flight == 6)
    assert r.capacity == 6
    caps = [p for p in r.history if p.kind == "capacity"]
    assert [(p.t, p.capacity) for p in caps] == [(0, 2), (1, 6)]

    # Shrinking never cancels; new work waits until active < capacity.
    clock.advance(1)
    reps.count = 1
    r.notify_capacity_changed()
    await asyncio.sleep(0)
    assert gen.in_flight == 6 and r.capacity == 2
    for rid in list(gen.waiting)[:4]:
        gen.complete(rid)
    await until(lambda: r.active_tasks == 2)
    await asyncio.sleep(0)
    assert gen.in_flight == 2 and len(gen.calls) == 6
    gen.complete(next(iter(gen.waiting)))
    await until(lambda: len(gen.calls) == 7)
    assert [p.capacity for p in r.history if p.kind == "capacity"] == [2, 6, 2]
    # Capacity is capped by max_required_samples.
    reps.count = 1000
    r.notify_capacity_changed()
    assert r.capacity == r.config.max_required_completions == r.config.max_required_samples * r.config.n
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_rollout_utilization_matches_the_formula_by_hand() -> None:
    r, q, gen, reps, clock = make(n=1, trigger=4, staleness=0.0, per_replica=2, replicas=1, data=prompts(2))
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 2)  # t=0: capacity 2, two submitted
    clock.advance(10)
    gen.complete(gen.calls[0].request_id)
    await until(lambda: r.active_tasks == 1)  # t=10: one active
    clock.advance(20)
    m1 = r.reset_staleness(1)  # t=30
    assert m1[UTILIZATION_METRIC] == pytest.approx((10 * 2 + 20 * 1) / (30 * 2))
    assert m1[STEP_GENERATED_METRIC] == 1
    assert [(p.t, p.active_tasks, p.capacity) for p in r.last_window_history if p.kind != "submit"] == [
        (0, 0, 2), (0, 0, 2), (10, 1, 2), (30, 1, 2)]

    reps.count = 2
    r.notify_capacity_changed()  # t=30: capacity 4
    clock.advance(10)
    m2 = r.reset_staleness(2)  # t=40
    assert m2[UTILIZATION_METRIC] == pytest.approx((10 * 1) / (10 * 4))
    gen.complete_all()
    await run
    assert rollout_resource_utilization([]) == 0.0


async def test_generate_failure_propagates_from_run_and_fails_the_queue() -> None:
    r, q, gen, _, _ = make(n=2, data=prompts(3), max_retries=1)
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 6)
    gen.fail("p1#1/0", ConnectionError("boom"))  # first attempt: retried
    await until(lambda: sum(c.request_id == "p1#1/0" for c in gen.calls) == 2)
    gen.fail("p1#1/0", ConnectionError("boom again"))  # beyond its retries
    with pytest.raises(RolloutFailed) as info:
        await run
    assert isinstance(info.value.__cause__, ConnectionError)
    assert r.active_tasks == 0 and gen.in_flight == 0  # the others were cancelled
    assert not q.closed  # never a normal end of data
    with pytest.raises(RolloutFailed):
        await q.get_batch(2, timeout=0)
    assert r.stats()["retries"] == 1


async def test_retry_within_budget_succeeds() -> None:
    r, q, gen, _, _ = make(n=1, data=prompts(1), max_retries=2)
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 1)
    gen.fail("p0#0/0", TimeoutError("slow"))
    await until(lambda: gen.in_flight == 1)
    gen.complete("p0#0/0")
    stats = await run
    assert stats["retries"] == 1 and stats["completed_samples"] == 1 and q.size() == 1


async def test_data_source_error_is_a_failure() -> None:
    def broken():
        yield Prompt("p0", [1])
        raise OSError("dataset read failed")

    clock = ManualClock()
    q = MessageQueue(10)
    gen = FakeGenerate()
    r = Rollouter(RolloutConfig(n=1, ppo_mini_batch_size=1), q, gen, broken(), lambda: 1, clock=clock,
                  capacity_poll_interval=None)
    with pytest.raises(RolloutFailed) as info:
        await r.run()
    assert isinstance(info.value.__cause__, OSError)
    assert gen.in_flight == 0 and r.active_tasks == 0  # p0 was cancelled, still pending
    assert [p["group_id"] for p in r.state_dict()["pending"]] == ["p0#0"]
    assert q.error is not None and not q.closed


async def test_checkpoint_keeps_queued_and_in_flight_samples() -> None:
    data = prompts(3)
    r, q, gen, _, _ = make(n=2, data=data)
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 6)
    gen.complete("p0#0/0")
    gen.complete("p0#0/1")  # group p0 complete -> queued
    gen.complete("p1#1/1")  # half of group p1
    await until(lambda: r.active_tasks == 3)
    run.cancel()  # shutting down for a checkpoint
    with pytest.raises(asyncio.CancelledError):
        await run
    state = json.loads(json.dumps({"queue": q.state_dict(), "rollouter": r.state_dict()}))
    assert state["rollouter"]["prompts_taken"] == 3
    assert [p["group_id"] for p in state["rollouter"]["pending"]] == ["p1#1", "p2#2"]

    # Restart: new objects, data source resumed after the prompts already taken.
    q2 = MessageQueue(100)
    q2.load_state_dict(state["queue"])
    gen2 = FakeGenerate()
    r2 = Rollouter(r.config, q2, gen2, data[state["rollouter"]["prompts_taken"]:], lambda: 10,
                   capacity_poll_interval=None)
    r2.load_state_dict(state["rollouter"])
    run2 = asyncio.create_task(r2.run())
    await until(lambda: gen2.in_flight == 3)
    assert sorted(c.request_id for c in gen2.calls) == ["p1#1/0@1", "p2#2/0@1", "p2#2/1@1"]
    gen2.complete_all()
    stats = await run2
    assert stats["groups_enqueued"] == 3 and stats["completed_samples"] == 6
    batch = await q2.get_batch(6, timeout=0)
    assert [(s.group_id, s.index) for s in batch.samples] == [
        ("p0#0", 0), ("p0#0", 1), ("p1#1", 0), ("p1#1", 1), ("p2#2", 0), ("p2#2", 1)]
    assert q2.generated == q2.consumed == 6


async def test_every_generated_sample_is_consumed_or_counted_as_dropped() -> None:
    # Queue holds 2 groups; 3 groups in flight at once force one overflow.
    r, q, gen, _, _ = make(n=2, trigger=10, staleness=1.0, max_queue=4, per_replica=6, replicas=1,
                           data=prompts(5))
    run = asyncio.create_task(r.run())
    await until(lambda: gen.in_flight == 6)
    gen.complete_all()
    await until(lambda: r.paused == "queue_full" and gen.in_flight == 0)
    assert q.dropped == 2 and [s.group_id for s in q.peek()] == ["p1#1", "p1#1", "p2#2", "p2#2"]
    consumed: list[str] = []
    while True:
        gen.complete_all()
        batch = await q.get_batch(2, timeout=0)
        consumed += [s.group_id for s in batch.samples]
        if batch.end_of_data:
            break
        await until(lambda: gen.in_flight > 0 or run.done() or q.size() > 0)
    stats = await run
    assert stats["completed_samples"] == q.generated == 10
    assert q.generated == q.consumed + q.dropped and q.size() == 0
    assert stats["dropped_by_queue"] == q.dropped == 2
    assert len(consumed) == q.consumed == 8
    assert "p0#0" not in consumed and sorted(set(consumed)) == ["p1#1", "p2#2", "p3#3", "p4#4"]
