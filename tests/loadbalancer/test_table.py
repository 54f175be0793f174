"""The routing policy, without I/O: ties, stickiness, removal, versions, rebalance plans."""

from __future__ import annotations

from collections import Counter

import pytest

from loadbalancer.routing.least_loaded import LeastLoaded
from loadbalancer.routing.sticky import SessionAffinity
from loadbalancer.table import OutlierDetection, Route, RoutingTable
from mesh_runtime.errors import AlreadyExists, InvalidArgument, NotFound

pytestmark = pytest.mark.timeout(30)


def chain(gap: int = 2, idle_s: float | None = None) -> list:
    return [SessionAffinity(max_load_gap=gap, max_sessions=1000, idle_s=idle_s), LeastLoaded()]


def table(n: int = 4, *, gap: int = 2, lag: int | None = None, versions=None) -> RoutingTable:
    t = RoutingTable(chain(gap), max_version_lag=lag)
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}", weight_version=(versions or [0] * n)[i]) for i in range(n))
    return t


def test_ties_are_broken_fairly_for_sequential_new_sessions():
    t = table(4)
    counts = Counter()
    for i in range(100):
        choice = t.pick(f"q{i}", session_id=f"s{i}")
        counts[choice.ticket.route.replica_id] += 1
        t.release(choice.ticket, completed=True)  # idle again before the next session
    assert all(20 <= counts[f"r{i}"] <= 30 for i in range(4)), counts
    assert sum(t.sticky_count(f"r{i}") for i in range(4)) == 100


def test_least_loaded_wins_and_concurrent_sessions_spread_evenly():
    t = table(4)
    picks = [t.pick(f"q{i}", session_id=f"s{i}") for i in range(100)]
    assert Counter(p.ticket.route.replica_id for p in picks) == {f"r{i}": 25 for i in range(4)}


def test_sticky_sessions_hold_until_the_load_gap_is_exceeded():
    t = table(2, gap=2)
    first = t.pick("a0", session_id="s").ticket
    home = first.route.replica_id
    hits = [t.pick(f"a{i}", session_id="s") for i in range(1, 3)]  # home now 3 in flight, other 0
    assert all(c.sticky_hit and c.ticket.route.replica_id == home for c in hits)
    moved = t.pick("a3", session_id="s")  # 3 - 0 > 2: the session leaves
    assert moved.sticky_migrated and moved.ticket.route.replica_id != home
    assert t.sticky_replica("s") == moved.ticket.route.replica_id


def test_removal_drops_sticky_pins_and_revokes_unsent_tickets():
    t = table(2)
    choice = t.pick("q", session_id="s")
    victim = choice.ticket.route.replica_id
    removed, dropped = t.remove([victim, "unknown"])
    assert [r.replica_id for r in removed] == [victim] and dropped == 1
    assert choice.ticket.revoked
    assert t.sticky_replica("s") is None
    assert all(t.pick(f"x{i}").ticket.route.replica_id != victim for i in range(5))


def test_version_floor_from_request_and_from_lag():
    t = table(3, versions=[1, 2, 3])
    assert {t.pick(f"a{i}", min_weight_version=2).ticket.route.replica_id for i in range(6)} == {"r1", "r2"}
    assert t.pick("none", min_weight_version=4) is None
    assert "weight_version 3 < required 4" in t.explain_ineligible(4)
    lagged = table(3, lag=1, versions=[1, 2, 3])
    assert {lagged.pick(f"b{i}").ticket.route.replica_id for i in range(6)} == {"r1", "r2"}
    lagged.update("r0", weight_version=3)
    assert lagged.pick("c", min_weight_version=None) is not None and len(lagged.eligible(None)) == 3


def test_add_validates_before_changing_anything():
    t = table(1)
    with pytest.raises(InvalidArgument):
        t.add([Route("new", "127.0.0.1:1"), Route("bad", "no-port")])
    with pytest.raises(AlreadyExists):
        t.add([Route("r0", "127.0.0.1:9")])
    assert list(t.routes) == ["r0"]
    t.add([Route("r0", "127.0.0.1:1000", weight_version=5)])  # same endpoint: a no-op apart from the version
    assert t.routes["r0"].weight_version == 5
    with pytest.raises(NotFound):
        t.update("zz", weight_version=1)


def test_rebalance_plan_moves_only_the_excess_cheapest_first():
    t = table(3)
    tickets = []
    for i in range(6):
        choice = t.pick(f"q{i}", avoid=frozenset({"r1", "r2"}))  # pile everything onto r0
        choice.ticket.sent, choice.ticket.tokens = True, 10 * i
        tickets.append(choice.ticket)
    moves = t.plan_moves(None)
    assert [m.request_id for m in moves] == ["q0", "q1", "q2", "q3"]  # share = 2; fewest tokens first
    assert [m.request_id for m in t.plan_moves(1)] == ["q0"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def outlier_table(n: int = 4, **od) -> tuple[RoutingTable, _Clock]:
    clock = _Clock()
    t = RoutingTable(chain(), outlier=OutlierDetection(**{"consecutive_failures": 3, "base_ejection_s": 5.0, **od}),
                     clock=clock)
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(n))
    return t, clock


def test_consecutive_failures_eject_a_replica_for_longer_each_time_until_it_answers():
    t, clock = outlier_table()
    r0 = t.get("r0")
    assert not t.unreachable(r0, "UNAVAILABLE: refused") and not t.unreachable(r0, "UNAVAILABLE: refused")
    assert t.unreachable(r0, "UNAVAILABLE: refused")                      # the third in a row ejects
    assert "ejected for 5.0 s more: 3 consecutive failures" in t.unroutable_reason(r0, None)
    assert r0 not in t.eligible(None) and t.next_ejection_end() == pytest.approx(5.0)
    clock.now += 5.1
    assert r0 in t.eligible(None)                                          # one try after the ejection
    assert t.unreachable(r0, "UNAVAILABLE: refused")                      # ... fails: at once again, for 10 s
    assert t.next_ejection_end() == pytest.approx(10.0)
    clock.now += 10.1
    t.answered(r0)                                                         # it answers: all forgotten
    assert (r0.breaker.consecutive_failures, r0.breaker.ejections) == (0, 0) and r0 in t.eligible(None)
    assert not t.unreachable(r0, "x")


def test_a_success_between_failures_resets_the_count():
    t, _ = outlier_table()
    r0 = t.get("r0")
    t.unreachable(r0, "x")
    t.unreachable(r0, "x")
    t.answered(r0)
    assert not t.unreachable(r0, "x") and not t.unreachable(r0, "x") and r0 in t.eligible(None)


def test_ejection_is_capped_and_never_takes_the_last_replica():
    t, _ = outlier_table(4, max_ejection_percent=50)
    for rid in ("r0", "r1", "r2"):
        for _ in range(3):
            t.unreachable(t.get(rid), "x")
    assert [r.replica_id for r in t.eligible(None)] == ["r2", "r3"]       # 50% of 4: two ejected at most
    t2, _ = outlier_table(2, max_ejection_percent=100)
    for rid in ("r0", "r1"):
        for _ in range(3):
            t2.unreachable(t2.get(rid), "x")
    assert [r.replica_id for r in t2.eligible(None)] == ["r1"]            # one always stays


def test_idle_sticky_pins_expire_and_closed_sessions_are_forgotten():
    now = [0.0]
    t = RoutingTable(chain(idle_s=60), clock=lambda: now[0])
    t.add(Route(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(2))
    t.release(t.pick("a", session_id="old").ticket, completed=True)
    now[0] = 30.0
    t.release(t.pick("b", session_id="young").ticket, completed=True)
    now[0] = 70.0                                         # "old" idle 70 s, "young" 40 s
    t.release(t.pick("c", session_id="other").ticket, completed=True)
    assert t.sticky_replica("old") is None and t.sticky_replica("young") is not None
    assert t.drop_session("young") is not None and t.drop_session("young") is None
    assert t.sticky_sessions == 1
