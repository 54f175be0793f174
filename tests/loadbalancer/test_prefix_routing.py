"""Prefix-aware routing on the table, without I/O and on a virtual clock: affinity, spill, eviction, removal,
warm-up of new replicas, rebalance."""

from __future__ import annotations

from collections import Counter

import pytest

from loadbalancer.prefix_index import PrefixIndex, PrefixPolicy, PromptKeys
from loadbalancer.routing.prefix_aware import PrefixAware
from loadbalancer.routing.sticky import SessionAffinity
from loadbalancer.table import Route, RoutingTable
from mesh_runtime.prefix import block_keys

pytestmark = pytest.mark.timeout(30)
BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(n: int = 4, *, gap: int = 2, ratio: float = 0.0, capacity: int = 4096, warmup: float = 0.0,
          clock: Clock | None = None) -> RoutingTable:
    policy = PrefixPolicy(PrefixIndex(block_tokens=BLOCK, capacity_tokens=capacity),
                          max_load_gap=gap, max_load_ratio=ratio, warmup_s=warmup)
    t = RoutingTable([SessionAffinity(max_load_gap=4, max_sessions=1000, idle_s=None), PrefixAware(policy)],
                     clock=clock or Clock())
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(n))
    return t


def prompt(k: int, length: int = 40) -> list[int]:
    return [1000 * k + i for i in range(length)]


def pick(t: RoutingTable, rid: str, tokens: list[int], **kw):
    return t.pick(rid, prefix_keys=PromptKeys(tokens), **kw)


def test_a_group_and_a_growing_context_follow_the_prompt():
    t = table(4, gap=100)
    first = pick(t, "g0", prompt(1))
    assert first.prefix_tokens == 0
    home = first.ticket.route.replica_id
    group = [pick(t, f"g{i}", prompt(1)) for i in range(1, 16)]
    assert {c.ticket.route.replica_id for c in group} == {home}
    assert all(c.prefix_tokens == 40 for c in group)
    turn2 = pick(t, "t2", prompt(1) + [7] * 12)        # the next turn: a longer context starting the same way
    assert turn2.ticket.route.replica_id == home and turn2.prefix_tokens == 40
    other = pick(t, "o", prompt(2))                      # a new prompt goes to the least loaded
    assert other.ticket.route.replica_id != home and other.prefix_tokens == 0


def test_a_loaded_replica_spills_to_the_least_loaded_which_then_shares_the_prompt():
    t = table(3, gap=2)
    picks = [pick(t, f"g{i}", prompt(1)) for i in range(12)]
    homes = Counter(c.ticket.route.replica_id for c in picks)
    assert sum(c.prefix_spilled for c in picks) >= 1
    assert max(homes.values()) - min(homes.values()) <= 3   # within the gap of 2 (and the pick that spilled)
    later = [pick(t, f"h{i}", prompt(1)) for i in range(3)]
    assert all(c.prefix_tokens == 40 for c in later)       # every replica that took it holds it now


def test_the_load_ratio_widens_the_gap_with_load():
    t = table(2, gap=0, ratio=0.5)
    for i in range(10):                                     # r0 and r1 carry 10 each of unrelated work
        pick(t, f"a{i}", prompt(100 + i))
        pick(t, f"b{i}", prompt(200 + i))
    counts = Counter(c.ticket.route.replica_id for c in (pick(t, f"g{i}", prompt(1)) for i in range(6)))
    assert max(counts.values()) == 6                        # 10 + 5 <= 10 + 0.5 * 10: all six stay together


def test_entries_age_out_as_the_engine_evicts_them_and_a_removed_replica_takes_its_entries():
    t = table(2, gap=100, capacity=16 * BLOCK)              # 16 blocks remembered per replica
    first = pick(t, "x", prompt(1)).ticket
    home = first.route.replica_id
    t.release(first, completed=True)
    for k in range(2, 4):                                   # 20 newer blocks sent to the same replica
        c = pick(t, f"y{k}", prompt(k), avoid=frozenset({"r1" if home == "r0" else "r0"}))
        t.release(c.ticket, completed=True)
    assert t.prefix.index.blocks(home) == 16
    again = pick(t, "x2", prompt(1))
    assert again.prefix_tokens == 0                         # its blocks went first (least recently used)
    t.release(again.ticket, completed=True)
    keep = pick(t, "z", prompt(3)).ticket.route.replica_id
    t.remove([keep])
    assert t.prefix.index.blocks(keep) == 0
    assert pick(t, "z2", prompt(3)).prefix_tokens == 0      # nothing of the removed replica is matched


def test_a_new_replica_is_filled_gradually():
    clock = Clock()
    t = table(2, gap=2, warmup=30.0, clock=clock)
    for i in range(40):                                     # 20 in flight on each
        pick(t, f"w{i}", prompt(300 + i))
    clock.now = 100.0
    t.add([Route("new", "127.0.0.1:2000")])
    early = Counter(pick(t, f"e{i}", prompt(400 + i)).ticket.route.replica_id for i in range(20))
    assert 0 < early["new"] < 20                            # counts as loaded as the others, less its age: not all
    clock.now = 131.0                                       # warm-up over: plain least loaded
    late = Counter(pick(t, f"l{i}", prompt(500 + i)).ticket.route.replica_id for i in range(10))
    assert late["new"] == 10


def test_rebalance_moves_tickets_and_their_resume_lands_on_a_replica_that_takes_the_prompt():
    t = table(2, gap=100)
    picks = [pick(t, f"g{i}", prompt(1)) for i in range(8)]
    for c in picks:
        c.ticket.sent = True
    home = picks[0].ticket.route.replica_id
    moves = t.plan_moves(None)
    assert len(moves) == 4 and {m.route.replica_id for m in moves} == {home}
    for ticket in moves:                                    # each resumes away from where it was
        t.release(ticket)
        moved = pick(t, ticket.request_id, prompt(1), avoid=frozenset({home}))
        assert moved.ticket.route.replica_id != home
    assert t.prefix.index.blocks("r0") == t.prefix.index.blocks("r1") == 10


def test_the_policy_is_chosen_in_config_and_bad_settings_are_refused(tmp_path):
    from loadbalancer.config import LoadBalancerConfig
    from loadbalancer.service import build_balancer
    from mesh_runtime.config import ConfigError, load_config

    path = tmp_path / "lb.yaml"
    path.write_text("routing_policy: prefix_aware\nprefix_routing: {block_tokens: 32, cache_tokens: 64000}\n")
    config = load_config(LoadBalancerConfig, path)
    config.validate()
    policy = build_balancer(config, None).table.prefix
    assert policy is not None and policy.index.block_tokens == 32 and policy.index.capacity_blocks("r0") == 2000
    assert build_balancer(LoadBalancerConfig(), None).table.prefix is not None      # the default
    assert build_balancer(LoadBalancerConfig(routing_policy="least_loaded"), None).table.prefix is None
    for text, key in (("routing_policy: cache_aware\n", "routing_policy"),
                      ("prefix_routing: {block_tokens: 0}\n", "block_tokens"),
                      ("prefix_routing: {max_load_ratio: -1}\n", "max_load_ratio"),
                      ("prefix_routing: {cache_tokens: 8, block_tokens: 64}\n", "cache_tokens"),
                      ("prefix_routing: {block_tokenz: 8}\n", "block_tokenz")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=key):
            load_config(LoadBalancerConfig, path).validate()


def test_engine_events_replace_predictions_at_the_engines_block_size(caplog):
    """Events give a replica's block size: it is indexed at that size from then on (its predicted entries of
    the table's size dropped), so engines of any block size, mixed in one fleet, are matched; events of
    another agent's replica, or with no block size, change nothing."""
    from loadbalancer.prefix_events import PrefixWatchers
    from rollmesh.replica.v1 import replica_agent_pb2

    t = table(3, gap=100)
    index = t.prefix.index
    tokens = prompt(1)
    keys, keys16 = block_keys(tokens, BLOCK), block_keys(tokens, 16)
    index.record("r2", PromptKeys(tokens))                  # predicted at the table's size
    watchers = PrefixWatchers(t, lambda address: None)
    event = replica_agent_pb2.WatchPrefixCacheResponse
    watchers._apply("127.0.0.1:1000", event(replica_id="r0", block_tokens=BLOCK, reset=True, stored=keys[:4]))
    assert index.match(PromptKeys(tokens), {"r0", "r1"}) == {"r0": 4 * BLOCK}
    watchers._apply("127.0.0.1:1000", event(replica_id="r0", block_tokens=BLOCK, removed=keys[2:4]))
    assert index.match(PromptKeys(tokens), {"r0"}) == {"r0": 2 * BLOCK}
    # r1's engine uses 16-token blocks: it is matched at that size beside r0 at 4
    watchers._apply("127.0.0.1:1001", event(replica_id="r1", block_tokens=16, stored=keys16))
    assert index.block_size("r1") == 16 and index.block_size("r0") == BLOCK
    assert index.match(PromptKeys(tokens), {"r0", "r1", "r2"}) == {"r0": 2 * BLOCK, "r1": 32, "r2": 40}
    # r2's first event, at 16: its 4-token predictions go, whatever its engine said it stored
    watchers._apply("127.0.0.1:1002", event(replica_id="r2", block_tokens=16, stored=keys16[:1]))
    assert index.match(PromptKeys(tokens), {"r2"}) == {"r2": 16} and index.blocks("r2") == 1
    # a route learns a 16-block replica's prompt at 16
    index.record("r2", PromptKeys(tokens))
    assert index.match(PromptKeys(tokens), {"r2"}) == {"r2": 32}
    applied = watchers.applied
    watchers._apply("127.0.0.1:1001", event(replica_id="r0", block_tokens=BLOCK, stored=keys))   # wrong agent
    watchers._apply("127.0.0.1:1001", event(replica_id="r1", block_tokens=0, reset=True))        # no size
    assert index.match(PromptKeys(tokens), {"r0", "r1"}) == {"r0": 2 * BLOCK, "r1": 32} and "no block size" in caplog.text
    watchers._apply("127.0.0.1:1000", event(replica_id="r0", block_tokens=BLOCK, reset=True))      # new weights
    assert index.blocks("r0") == 0 and watchers.applied == applied + 1
    t.remove(["r1"])                                        # a replica that leaves takes its size with it
    assert index.block_size("r1") == BLOCK and index.blocks("r1") == 0


def test_the_index_is_as_deep_as_the_prompt_and_bounded_by_tokens():
    """A shared 4,096-token head does not hide what follows it (the old cap of 128 blocks of 16 did); memory
    per replica stays within cache_tokens; max_prefix_tokens caps the depth when set."""
    head = prompt(9, 4096)
    index = PrefixIndex(block_tokens=16, capacity_tokens=20_000)
    index.record("a", index.prompt(head + prompt(1, 512)))
    index.record("b", index.prompt(head + prompt(2, 512)))
    assert index.match(index.prompt(head + prompt(2, 600)), {"a", "b"}) == {"a": 4096, "b": 4096 + 512}
    for k in range(20, 30):                                 # more context than a's cache: its oldest goes
        index.record("a", index.prompt(prompt(k, 2048)))
    assert index.blocks("a") <= 20_000 // 16 and index.match(index.prompt(head), {"a"}) == {}
    capped = PrefixIndex(block_tokens=16, capacity_tokens=20_000, max_prefix_tokens=2048)
    capped.record("a", capped.prompt(head + prompt(1, 512)))
    capped.record("b", capped.prompt(head + prompt(2, 512)))
    assert capped.match(capped.prompt(head + prompt(2, 600)), {"a", "b"}) == {"a": 2048, "b": 2048}


async def test_a_broken_event_stream_is_opened_again_with_a_backoff_that_starts_over_after_events(monkeypatch):
    """Streams that break before delivering wait longer each time; one that delivered starts the backoff over;
    an agent that serves no WatchPrefixCache is left alone."""
    import asyncio

    import grpc

    from loadbalancer.prefix_events import PrefixWatchers
    from rollmesh.replica.v1 import replica_agent_pb2

    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float, result=None):
        waits.append(seconds)
        await real_sleep(0)
        return result

    monkeypatch.setattr(asyncio, "sleep", sleep)
    t = table(1, gap=100)
    keys = block_keys(prompt(1), BLOCK)
    event = replica_agent_pb2.WatchPrefixCacheResponse(replica_id="r0", block_tokens=BLOCK, stored=keys[:2])
    broken = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    script = [[broken], [broken], [event, broken], [broken], [event]]   # then the stream ends: no more events
    opened: list[int] = []

    class Stub:
        def WatchPrefixCache(self, request):  # noqa: N802
            steps = script[len(opened)]
            opened.append(1)

            async def stream():
                for step in steps:
                    if isinstance(step, Exception):
                        raise step
                    yield step
            return stream()

    watchers = PrefixWatchers(t, lambda address: Stub(), retry_s=0.5, max_retry_s=10.0)
    await watchers._watch("127.0.0.1:1000")
    assert len(opened) == 5 and watchers.applied == 2
    assert waits == [0.5, 1.0, 0.5, 1.0]       # growing; after the stream that delivered it starts over

    class Unimplemented:
        def WatchPrefixCache(self, request):  # noqa: N802
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "")

    waits.clear()
    await PrefixWatchers(t, lambda address: Unimplemented())._watch("127.0.0.1:1000")
    assert waits == []
