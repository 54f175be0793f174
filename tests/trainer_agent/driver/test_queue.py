"""MessageQueue: oldest-first dropping with exact counts, bounded batch waits, checkpoints."""

from __future__ import annotations

import asyncio
import json

import pytest

from trainer_agent.driver import MessageQueue, QueueClosed, RolloutFailed, Sample
from tests.trainer_agent.driver.fakes import ManualClock, until

pytestmark = pytest.mark.timeout(60)


def sample(group: str, index: int = 0, version: int = 0) -> Sample:
    return Sample(
        group_id=group,
        index=index,
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        logprobs=[-0.1, -0.2, -0.3],
        param_version=version,
        weight_versions=[version, version + 1],
        segment_lengths=[1, 2],
    )


def group(gid: str, n: int = 2) -> list[Sample]:
    return [sample(gid, i) for i in range(n)]


def assert_balanced(q: MessageQueue) -> None:
    assert q.generated == q.consumed + q.dropped + q.size()


def test_put_drops_the_oldest_sample_and_counts_only_it() -> None:
    q = MessageQueue(3)
    for gid in "abc":
        assert q.put(sample(gid)) == 0
    assert q.put(sample("d")) == 1
    assert [s.group_id for s in q.peek()] == ["b", "c", "d"]  # the new one is kept
    assert (q.generated, q.dropped, q.consumed, q.size()) == (4, 1, 0, 3)
    assert_balanced(q)


def test_put_group_evicts_whole_oldest_groups() -> None:
    q = MessageQueue(4)
    assert q.put_group(group("g0")) == 0
    assert q.put_group(group("g1")) == 0
    assert q.put_group(group("g2")) == 2
    assert [(s.group_id, s.index) for s in q.peek()] == [("g1", 0), ("g1", 1), ("g2", 0), ("g2", 1)]
    assert (q.generated, q.dropped) == (6, 2)
    assert_balanced(q)
    with pytest.raises(ValueError):
        q.put_group(group("big", 5))
    assert q.generated == 6  # a rejected put changes nothing


async def test_eviction_of_a_partly_consumed_front_group() -> None:
    q = MessageQueue(4)
    q.put_group(group("g0"))
    q.put_group(group("g1"))
    got = await q.get_batch(1, timeout=0)
    assert [(s.group_id, s.index) for s in got.samples] == [("g0", 0)]
    # 3 queued, room for 1: the rest of g0 (one sample) is the oldest group.
    assert q.put_group(group("g2")) == 1
    assert [s.group_id for s in q.peek()] == ["g1", "g1", "g2", "g2"]
    assert (q.generated, q.consumed, q.dropped) == (6, 1, 1)
    assert_balanced(q)


async def test_get_batch_waits_for_missing_samples_and_reports_them() -> None:
    clock = ManualClock(100.0)
    q = MessageQueue(10, clock=clock)
    q.put(sample("a"))
    task = asyncio.create_task(q.get_batch(3, timeout=30))
    await until(lambda: q._changed.is_set() is False)  # the consumer is waiting
    assert not task.done()
    clock.advance(4.0)
    q.put(sample("b"))
    await asyncio.sleep(0)
    assert not task.done()
    q.put(sample("c"))
    result = await task
    assert [s.group_id for s in result.samples] == ["a", "b", "c"]
    assert (result.requested, result.size_at_start, result.wait_samples) == (3, 1, 2)
    assert result.waited_s == pytest.approx(4.0)
    assert not result.timed_out and not result.end_of_data
    assert q.consumed == 3 and q.size() == 0


async def test_get_batch_is_bounded_and_returns_what_it_got() -> None:
    q = MessageQueue(10)
    q.put(sample("a"))
    result = await q.get_batch(4, timeout=0.02)
    assert result.timed_out
    assert [s.group_id for s in result.samples] == ["a"]
    assert result.wait_samples == 3  # max(0, n - size_at_start)
    empty = await q.get_batch(2, timeout=0)
    assert empty.samples == [] and empty.timed_out and empty.wait_samples == 2
    # Enough queued: no waiting at all.
    q.put_group(group("g", 3))
    full = await q.get_batch(2, timeout=0)
    assert len(full.samples) == 2 and full.wait_samples == 0 and not full.timed_out
    assert_balanced(q)


async def test_failure_propagates_to_waiting_and_later_consumers() -> None:
    q = MessageQueue(10)
    q.put(sample("a"))
    waiter = asyncio.create_task(q.get_batch(5, timeout=30))
    await until(lambda: not q._changed.is_set())
    q.fail(RuntimeError("lb down"))
    with pytest.raises(RolloutFailed) as info:
        await waiter
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RolloutFailed):
        await q.get_batch(1, timeout=0)
    assert q.size() == 1 and q.consumed == 0  # nothing vanished
    with pytest.raises(QueueClosed):
        q.put(sample("b"))


async def test_close_is_a_normal_end_of_data() -> None:
    q = MessageQueue(10)
    q.put(sample("a"))
    waiter = asyncio.create_task(q.get_batch(5, timeout=30))
    await until(lambda: not q._changed.is_set())
    q.close()
    result = await waiter
    assert [s.group_id for s in result.samples] == ["a"]
    assert result.end_of_data and not result.timed_out


async def test_state_dict_round_trip_keeps_queued_samples_and_counters() -> None:
    q = MessageQueue(4)
    q.put_group(group("g0"))
    q.put_group(group("g1"))
    q.put_group(group("g2"))  # drops g0
    await q.get_batch(1, timeout=0)
    q.peek()[0].reward = 0.75
    state = json.loads(json.dumps(q.state_dict()))

    restored = MessageQueue(4)
    restored.load_state_dict(state)
    assert restored.peek() == q.peek()
    assert restored.stats() == q.stats()
    assert restored.peek()[0].reward == 0.75
    assert restored.peek()[0].weight_versions == [0, 1]
    got = await restored.get_batch(3, timeout=0)
    assert [(s.group_id, s.index) for s in got.samples] == [("g1", 1), ("g2", 0), ("g2", 1)]
    assert_balanced(restored)

    bad = dict(state, generated=state["generated"] + 1)
    with pytest.raises(ValueError):
        MessageQueue(4).load_state_dict(bad)
