"""The routing pieces (loadbalancer/routing): a new policy is a module and one line of registration; the
version filter and the per-route breaker take replicas out of every policy's picks; session affinity sits in
front of whichever selector ends the chain."""

from __future__ import annotations

import pytest

from loadbalancer import routing
from loadbalancer.config import LoadBalancerConfig, OutlierDetectionConfig
from loadbalancer.routing.breaker import OutlierDetection
from loadbalancer.routing.least_loaded import LeastLoaded
from loadbalancer.routing.sticky import SessionAffinity
from loadbalancer.service import build_balancer
from loadbalancer.table import Route, RoutingTable
from mesh_runtime.config import ConfigError

from .policy_plugin import FewestCompleted

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def plugin():
    routing.register("fewest_completed", lambda config: FewestCompleted())   # the one line
    yield
    del routing.POLICIES["fewest_completed"]


def _routes(n: int, versions=None) -> list[Route]:
    return [Route(f"r{i}", f"127.0.0.1:{1000 + i}", weight_version=(versions or [0] * n)[i]) for i in range(n)]


def test_a_registered_policy_is_chosen_by_name_and_keeps_the_shared_pieces(plugin):
    config = LoadBalancerConfig(routing_policy="fewest_completed", max_version_lag=1,
                                outlier_detection=OutlierDetectionConfig(consecutive_failures=1,
                                                                          base_ejection_s=60.0))
    config.validate()
    table = build_balancer(config, None).table
    table.add(_routes(4, versions=[2, 2, 2, 0]))
    selector = table.selectors[-1]
    assert isinstance(selector, FewestCompleted) and table.prefix is None
    first = table.pick("a", session_id="s")
    assert first.ticket.route.replica_id == "r0"        # its own rule: fewest completed, lowest id
    table.release(first.ticket, completed=True)
    assert table.pick("b").ticket.route.replica_id == "r1"
    assert table.pick("c", session_id="s").sticky_hit   # session affinity still in front of it
    assert table.unreachable(table.get("r1"), "UNAVAILABLE: gone")           # the breaker opens for r1
    picked = {table.pick(f"d{i}").ticket.route.replica_id for i in range(4)}
    assert picked == {"r2"}                              # r3 is too far behind (max_version_lag 1), r1 ejected,
    table.remove(["r2"])                                 # r0 has completed one
    assert "r2" not in selector.chose and table.pick("e").ticket.route.replica_id == "r0"


def test_an_unknown_policy_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"routing_policy.*unknown policy 'cache_awa.*least_loaded, prefix_aware"):
        LoadBalancerConfig(routing_policy="cache_aware" * 20).validate()


def test_the_version_filter_and_the_breaker_explain_why_a_replica_is_out():
    table = RoutingTable([LeastLoaded()], max_version_lag=2, outlier=OutlierDetection(consecutive_failures=1))
    table.add(_routes(3, versions=[5, 2, 5]))
    assert table.unroutable_reason(table.get("r1")) == "weight_version 2 < required 3"
    assert table.unroutable_reason(table.get("r0"), 6) == "weight_version 5 < required 6"
    assert table.pick("x", min_weight_version=6) is None
    table.unreachable(table.get("r2"), "UNAVAILABLE: refused")
    assert table.unroutable_reason(table.get("r2")).startswith("ejected for 5.0 s more: 1 consecutive failures")
    assert [r.replica_id for r in table.eligible(None)] == ["r0"]
    assert "r1: weight_version 2 < required 3" in table.explain_ineligible(None)


def test_a_chain_without_session_affinity_has_no_pins():
    table = RoutingTable([LeastLoaded()])
    table.add(_routes(2))
    assert not table.pick("a", session_id="s").sticky_hit and table.sticky_sessions == 0
    assert table.sticky_replica("s") is None and table.clear_sticky() == 0
    sticky = RoutingTable([SessionAffinity(max_load_gap=0, max_sessions=10, idle_s=None), LeastLoaded()])
    sticky.add(_routes(2))
    held = sticky.pick("a", session_id="s")
    moved = sticky.pick("b", session_id="s")             # its replica is 1 above the least: gap 0 moves it
    assert moved.sticky_migrated and moved.ticket.route is not held.ticket.route
    assert sticky.sticky_replica("s") == moved.ticket.route.replica_id
