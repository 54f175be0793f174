"""``routing_policy: prefix_cost`` on the table, without I/O: load counted in tokens, affinity bounded by it. A
prompt many share spreads as its load needs while a trajectory keeps the replica caching its context unless
another is lighter by more than the prefill a move costs; a GRPO group stays together; with no information it
is least loaded."""

from __future__ import annotations

from collections import Counter

import pytest

from loadbalancer.config import LoadBalancerConfig, PrefixRoutingConfig
from loadbalancer.prefix_index import PrefixIndex, PromptKeys
from loadbalancer.routing import selectors
from loadbalancer.routing.prefix_cost import PrefixCost
from loadbalancer.routing.sticky import SessionAffinity
from loadbalancer.table import Route, RoutingTable

pytestmark = pytest.mark.timeout(30)
BLOCK = 16


def table(n: int = 4, *, excess: float = 0.25, prefill_weight: float = 32.0, prefill_load: float = 0.0
          ) -> RoutingTable:
    cost = PrefixCost(PrefixIndex(block_tokens=BLOCK, capacity_tokens=1_000_000),
                      prefill_weight=prefill_weight, max_load_excess=excess, prefill_load=prefill_load)
    t = RoutingTable([cost], clock=lambda: 0.0)
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(n))
    return t


def tokens(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 2 for i in range(length)]


def pick(t: RoutingTable, rid: str, prompt: list[int], max_tokens: int = 256, session_id: str = ""):
    return t.pick(rid, prefix_keys=PromptKeys(prompt), prompt_tokens=len(prompt),
                  max_tokens=max_tokens, session_id=session_id)


def held(t: RoutingTable) -> dict[str, int]:
    return {r.replica_id: r.held_tokens for r in t.routes.values()}


def background(t: RoutingTable, per_replica: int = 20, length: int = 2000) -> None:
    """Work of their own on every replica, evenly: a fleet under load."""
    for r in list(t.routes):
        for i in range(per_replica):
            t.pick(f"{r}-bg{i}", prompt_tokens=length, max_tokens=256,
                   avoid=frozenset(other for other in t.routes if other != r))


def test_under_load_a_group_stays_together_where_its_prompt_is_cached():
    t = table(4)
    background(t)
    prompt = tokens(1, 2048)
    first = pick(t, "g0", prompt)
    home = first.ticket.route.replica_id
    assert first.ticket.weight == 2048 + 256 and first.prefix_tokens == 0
    siblings = [pick(t, f"g{i}", prompt) for i in range(1, 4)]
    assert {c.ticket.route.replica_id for c in siblings} == {home}
    assert all(c.prefix_tokens == 2048 for c in siblings)
    assert held(t)[home] == 20 * 2256 + 4 * 2304   # load is context: each sibling decodes over the prompt


def test_load_counts_tokens_a_replica_with_one_long_context_is_as_loaded_as_one_with_many_short():
    t = table(2, excess=10.0)
    long = pick(t, "long", tokens(1, 8192))
    shorts = [pick(t, f"s{i}", tokens(100 + i, 64)) for i in range(12)]
    other = {r for r in held(t) if r != long.ticket.route.replica_id}
    assert {c.ticket.route.replica_id for c in shorts} == other   # 12 short requests weigh less than the long one
    assert held(t)[long.ticket.route.replica_id] > held(t)[next(iter(other))]


def test_a_shared_document_spreads_as_its_load_needs_while_trajectories_keep_their_replicas():
    t = table(4)
    background(t, per_replica=8)
    document = tokens(9, 4096)
    homes = {}
    for j in range(8):   # eight trajectories of their own, spread over the fleet
        first = pick(t, f"own{j}-0", tokens(200 + j, 1024), session_id=f"own{j}")
        homes[j] = first.ticket.route.replica_id
    assert len(set(homes.values())) == 4
    doc = Counter(pick(t, f"doc{k}", document + tokens(300 + k, 256)).ticket.route.replica_id for k in range(24))
    assert len(doc) > 1 and max(doc.values()) < 24          # the document did not pile onto one replica
    stayed = 0
    for j in range(8):   # each trajectory's next turn: its context plus a response and an observation
        before = held(t)
        turn = pick(t, f"own{j}-1", tokens(200 + j, 1024) + tokens(400 + j, 300), session_id=f"own{j}")
        went = turn.ticket.route.replica_id
        if went == homes[j]:
            stayed += 1
            assert turn.prefix_tokens == 1024
        else:   # moved: its home was past the bound, or heavier by more than the prefill the move costs
            mean = (sum(before.values()) + 1324 + 256) / 4
            assert (before[homes[j]] + 1580 > 1.25 * mean
                    or before[went] + 32 * 1324 < before[homes[j]] + 32 * 300)
    assert stayed >= 6
    loads = held(t).values()
    mean = sum(loads) / 4
    assert max(loads) <= 1.25 * mean + 4096 + 256   # bounded: within the excess, give or take one request


def test_a_replica_prefilling_new_prompts_is_busier_than_one_holding_the_same_context_cached():
    """The document workload's hot spot: replicas holding few long cached contexts and replicas taking many
    new trajectories held the same tokens, but the latter also prefilled every one of them."""
    t = table(2, excess=10.0, prefill_load=2.0)
    contexts = [tokens(10 + i, 4000) for i in range(4)]
    for i, context in enumerate(contexts):   # r0 served these trajectories' earlier turns: it caches them
        t.release(t.pick(f"turn0-{i}", prefix_keys=PromptKeys(context), prompt_tokens=4000, max_tokens=256,
                         avoid=frozenset({"r1"})).ticket)
    cached = [pick(t, f"turn1-{i}", context + tokens(20 + i, 96)) for i, context in enumerate(contexts)]
    fresh = [t.pick(f"new{i}", prefix_keys=PromptKeys(tokens(30 + i, 4096)), prompt_tokens=4096, max_tokens=256,
                    avoid=frozenset({"r0"})) for i in range(4)]
    assert {c.ticket.route.replica_id for c in cached} == {"r0"} and all(c.prefix_tokens == 4000 for c in cached)
    assert all(c.ticket.weight == 4096 + 256 + 2 * 96 for c in cached)       # context + 2 x its uncached part
    assert all(c.ticket.weight == 4096 + 256 + 2 * 4096 for c in fresh)
    assert held(t) == {"r0": 4 * (4352 + 192), "r1": 4 * (4352 + 8192)}
    assert pick(t, "next", tokens(40, 1024)).ticket.route.replica_id == "r0"
    for choice in fresh:                      # what a request held leaves with it
        t.release(choice.ticket)
    assert held(t)["r1"] == 0


def test_a_loaded_replica_is_passed_over_for_a_cheaper_one_even_with_the_prompt_cached():
    t = table(2, excess=0.0)
    prompt = tokens(5, 512)
    home = pick(t, "a", prompt).ticket.route.replica_id
    for i in range(6):   # the home replica fills up with other work
        t.pick(f"x{i}", prompt_tokens=4096, max_tokens=256, avoid=frozenset(r for r in t.routes if r != home))
    again = pick(t, "b", prompt)
    assert again.ticket.route.replica_id != home and again.prefix_spilled and again.prefix_tokens == 0


def test_released_tokens_leave_the_replica_and_completions_teach_the_expected_length():
    t = table(2)
    choice = pick(t, "a", tokens(1, 512), max_tokens=4096)
    assert choice.ticket.weight == 512 + 256   # the initial expectation, before any request completed
    choice.ticket.tokens = 1000
    t.release(choice.ticket, completed=True)
    assert held(t) == {"r0": 0, "r1": 0}
    for i in range(200):
        c = pick(t, f"c{i}", tokens(2, 16), max_tokens=4096)
        c.ticket.tokens = 1000
        t.release(c.ticket, completed=True)
    assert pick(t, "next", tokens(3, 16), max_tokens=4096).ticket.weight == pytest.approx(16 + 1000, abs=20)
    assert pick(t, "capped", tokens(4, 16), max_tokens=100).ticket.weight == 16 + 100


def test_without_a_prompt_or_a_match_it_is_least_loaded():
    t = table(3)
    chosen = [t.pick(f"q{i}").ticket.route.replica_id for i in range(9)]
    assert Counter(chosen) == {"r0": 3, "r1": 3, "r2": 3}


def test_the_policy_is_configured_by_name_without_session_pins():
    config = LoadBalancerConfig(routing_policy="prefix_cost",
                                prefix_routing=PrefixRoutingConfig(block_tokens=16, prefill_weight=2.0,
                                                                   max_load_excess=0.5, prefill_load=3.0))
    config.validate()
    chain = selectors(config)
    [record, selector] = chain
    assert isinstance(selector, PrefixCost)
    assert (selector.prefill_weight, selector.max_load_excess, selector.prefill_load) == (2.0, 0.5, 3.0)
    assert selector.index.block_tokens == 16
    configured = RoutingTable(chain, clock=lambda: 0.0)
    assert configured.prefix is selector and configured.sessions is record and not record.steers
    # sessions are recorded, never pinned: CloseSession still finds the replica a session's last request went to
    configured.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(2))
    first = configured.pick("a", session_id="s", prefix_keys=PromptKeys(tokens(1, 64)), prompt_tokens=64)
    home = first.ticket.route.replica_id
    configured.pick("b", prefix_keys=PromptKeys(tokens(2, 64)), prompt_tokens=64)
    other = configured.pick("c", session_id="s", prefix_keys=PromptKeys(tokens(3, 64)), prompt_tokens=64)
    assert not other.sticky_hit and configured.sticky_replica("s") == other.ticket.route.replica_id
    assert configured.drop_session("s") == other.ticket.route.replica_id and configured.drop_session("s") is None
    with pytest.raises(Exception, match="max_load_excess"):
        PrefixRoutingConfig(max_load_excess=-1.0).validate()
    with pytest.raises(Exception, match="prefill_load"):
        PrefixRoutingConfig(prefill_load=-0.5).validate()


def test_pin_sessions_overrides_the_policys_own_way():
    for policy, pin, steers in (("prefix_cost", None, False), ("prefix_cost", True, True),
                                ("prefix_aware", None, True), ("prefix_aware", False, False),
                                ("least_loaded", False, False)):
        config = LoadBalancerConfig(routing_policy=policy, pin_sessions=pin)
        config.validate()
        assert RoutingTable(selectors(config)).sessions.steers is steers, (policy, pin)


def test_a_session_keeps_its_replica_by_cost_even_where_the_index_cannot_see_its_context():
    """Short prompts fill no block, so the index matches nothing: the session's last replica still counts as
    holding the last prompt, and the session stays there until that replica is past the bound."""
    sessions = SessionAffinity(max_load_gap=4, max_sessions=100, idle_s=None, steers=False)
    cost = PrefixCost(PrefixIndex(block_tokens=BLOCK, capacity_tokens=1_000_000),
                      prefill_weight=32.0, max_load_excess=0.25, prefill_load=2.0)
    t = RoutingTable([sessions, cost], clock=lambda: 0.0)
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(4))
    first = pick(t, "turn0", tokens(1, 6), max_tokens=4, session_id="s")
    home = first.ticket.route.replica_id
    t.release(first.ticket, completed=True)
    for turn in range(1, 6):   # unrelated short prompts under the same session, as an HTTP client may send
        choice = pick(t, f"turn{turn}", tokens(10 + turn, 6), max_tokens=4, session_id="s")
        assert choice.ticket.route.replica_id == home and choice.prefix_tokens == 0 and not choice.sticky_hit
        t.release(choice.ticket, completed=True)
    for i in range(8):   # its replica fills up past the bound
        t.pick(f"x{i}", prompt_tokens=2048, max_tokens=256, avoid=frozenset(r for r in t.routes if r != home))
    moved = pick(t, "turn6", tokens(20, 6), max_tokens=4, session_id="s")
    assert moved.ticket.route.replica_id != home
    assert t.sticky_replica("s") == moved.ticket.route.replica_id
    assert pick(t, "turn7", tokens(21, 6), max_tokens=4, session_id="s").ticket.route.replica_id \
        == moved.ticket.route.replica_id   # and keeps its new one
