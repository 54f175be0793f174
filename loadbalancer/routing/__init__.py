"""Routing policies as pieces.

A routing table runs filters (:class:`~.policy.Filter`: a weight version too old, a breaker open) and then a
chain of selectors (:class:`~.policy.Selector`), each of which chooses a replica or leaves the choice to the
next one; the last of a chain always chooses. ``routing_policy`` in the balancer's config names a chain in
:data:`POLICIES`. A new policy is a new module with its selector, and one line here (or a call of
:func:`register`) that names the chain it ends.
"""

from __future__ import annotations

from collections.abc import Callable

from ..prefix_index import PrefixIndex, PrefixPolicy
from .least_loaded import LeastLoaded
from .policy import Candidate, Filter, Pick, Selector, Settings
from .prefix_aware import PrefixAware
from .prefix_cost import PrefixCost
from .sticky import SessionAffinity

__all__ = ["POLICIES", "Candidate", "Filter", "Pick", "Selector", "Settings", "register", "selectors"]

PolicyFactory = Callable[[Settings], Selector]
"""Builds the selector that ends a chain from the balancer's config."""


def _index(config: Settings) -> PrefixIndex:
    pr = config.prefix_routing
    return PrefixIndex(block_tokens=pr.block_tokens, capacity_tokens=pr.cache_tokens,
                       max_prefix_tokens=pr.max_prefix_tokens)


def prefix_aware(config: Settings) -> PrefixAware:
    pr = config.prefix_routing
    return PrefixAware(PrefixPolicy(_index(config), max_load_gap=pr.max_load_gap, max_load_ratio=pr.max_load_ratio,
                                    warmup_s=pr.warmup_s))


def prefix_cost(config: Settings) -> PrefixCost:
    pr = config.prefix_routing
    return PrefixCost(_index(config), prefill_weight=pr.prefill_weight, max_load_excess=pr.max_load_excess,
                      prefill_load=pr.prefill_load)


POLICIES: dict[str, PolicyFactory] = {
    "least_loaded": lambda config: LeastLoaded(),
    "prefix_aware": prefix_aware,
    "prefix_cost": prefix_cost,
}
"""``routing_policy`` name -> the selector that ends its chain (sessions stick before it, unless the policy is
in :data:`UNPINNED`)."""

UNPINNED: set[str] = {"prefix_cost"}
"""Policies whose chain has no session pins: they keep a session where its context is cached on their own
(their chain's session piece only records where each session's last request went)."""


def register(name: str, factory: PolicyFactory, *, pins_sessions: bool = True) -> None:
    """Make ``routing_policy: name`` choose with the selector ``factory`` builds (a plug-in's one line);
    ``pins_sessions`` False: no session affinity before it."""
    POLICIES[name] = factory
    if pins_sessions:
        UNPINNED.discard(name)
    else:
        UNPINNED.add(name)


def selectors(config: Settings) -> list[Selector]:
    """The chain ``config.routing_policy`` names: session affinity (for an unpinned policy, or with
    ``pin_sessions`` false, one that only records where each session's last request went), then the policy's
    own selector."""
    own = POLICIES[config.routing_policy](config)
    pins = config.pin_sessions if config.pin_sessions is not None else config.routing_policy not in UNPINNED
    return [SessionAffinity(max_load_gap=config.sticky_max_load_gap, max_sessions=config.max_sticky_sessions,
                            idle_s=config.sticky_session_idle_s, steers=pins), own]
