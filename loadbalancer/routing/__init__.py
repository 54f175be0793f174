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
from .sticky import SessionAffinity

__all__ = ["POLICIES", "Candidate", "Filter", "Pick", "Selector", "Settings", "register", "selectors"]

PolicyFactory = Callable[[Settings], Selector]
"""Builds the selector that ends a chain from the balancer's config."""


def prefix_aware(config: Settings) -> PrefixAware:
    pr = config.prefix_routing
    return PrefixAware(PrefixPolicy(PrefixIndex(block_tokens=pr.block_tokens, capacity_tokens=pr.cache_tokens,
                                                max_blocks=pr.max_blocks),
                                    max_load_gap=pr.max_load_gap, max_load_ratio=pr.max_load_ratio,
                                    warmup_s=pr.warmup_s))


POLICIES: dict[str, PolicyFactory] = {
    "least_loaded": lambda config: LeastLoaded(),
    "prefix_aware": prefix_aware,
}
"""``routing_policy`` name -> the selector that ends its chain (sessions stick before it, whichever it is)."""


def register(name: str, factory: PolicyFactory) -> None:
    """Make ``routing_policy: name`` choose with the selector ``factory`` builds (a plug-in's one line)."""
    POLICIES[name] = factory


def selectors(config: Settings) -> list[Selector]:
    """The chain ``config.routing_policy`` names: session affinity, then the policy's own selector."""
    return [SessionAffinity(max_load_gap=config.sticky_max_load_gap, max_sessions=config.max_sticky_sessions,
                            idle_s=config.sticky_session_idle_s),
            POLICIES[config.routing_policy](config)]
