"""What a routing piece is: a filter that takes replicas out of a pick, or a selector that chooses among the
rest (or passes to the next selector). The table runs its filters, then its selectors in order, and tells
every selector which replica was chosen (a session's pin, a prefix index, a cursor learn from it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..prefix_index import PromptKeys, Routed


class Candidate(Routed, Protocol):
    """What the pieces read of a replica in the table (:class:`loadbalancer.table.Route`): what the prefix
    index reads (its id, requests in flight, when it joined) and more."""

    @property
    def weight_version(self) -> int: ...

    @property
    def completed(self) -> int: ...

    @property
    def held_tokens(self) -> int: ...


C = TypeVar("C", bound=Candidate)
R_contra = TypeVar("R_contra", contravariant=True)


class PrefixSettings(Protocol):
    """The prefix-aware piece's settings (the balancer config's ``prefix_routing``)."""

    @property
    def block_tokens(self) -> int: ...

    @property
    def cache_tokens(self) -> int: ...

    @property
    def max_prefix_tokens(self) -> int: ...

    @property
    def max_load_gap(self) -> int: ...

    @property
    def max_load_ratio(self) -> float: ...

    @property
    def warmup_s(self) -> float: ...

    @property
    def prefill_weight(self) -> float: ...

    @property
    def max_load_excess(self) -> float: ...

    @property
    def prefill_load(self) -> float: ...


class Settings(Protocol):
    """What a policy's factory may read of the balancer's config (:class:`loadbalancer.config.LoadBalancerConfig`)."""

    @property
    def routing_policy(self) -> str: ...

    @property
    def prefix_routing(self) -> PrefixSettings: ...

    @property
    def pin_sessions(self) -> bool | None: ...

    @property
    def sticky_max_load_gap(self) -> int: ...

    @property
    def max_sticky_sessions(self) -> int: ...

    @property
    def sticky_session_idle_s(self) -> float | None: ...


@dataclass
class Pick:
    """One request's pick, as the pieces see it; selectors note how they chose in its fields."""

    request_id: str
    now: float
    session_id: str = ""
    prefix_keys: PromptKeys | None = None
    """The prompt's leading block keys at each block size asked for, for a prefix-aware piece."""
    min_weight_version: int | None = None
    newest_version: int = 0
    """The newest weight version in the table, for a version-aware filter."""
    prompt_tokens: int = 0
    """The prompt's length in tokens (0: not known)."""
    expected_completion: int = 0
    """Tokens the request is expected to generate: the table's running mean of completions, capped by the
    request's ``max_tokens``."""

    session_replica: str = ""
    """The replica the session's last request went to ("": none known), set by the session piece whether or not
    it pins sessions."""
    session_tokens: int = 0
    """The prompt tokens of the session's last request, which its replica has prefilled."""

    sticky_hit: bool = False
    sticky_migrated: bool = False
    prefix_tokens: int = 0
    """Leading prompt tokens the chosen replica was found to hold, in whole blocks (prefix-aware routing)."""
    prefix_spilled: bool = False
    """A replica held part of the prompt but was too loaded (prefix-aware routing)."""
    held_weight: int = 0
    """Tokens of load the chosen replica takes on for the request (0: its prompt plus its expected completion);
    a selector that weighs load in tokens sets it."""


class Filter(Protocol[R_contra]):
    """Takes replicas out of picks (a weight version too old, a breaker open)."""

    def why_not(self, route: R_contra, pick: Pick) -> str:
        """Why ``route`` may not serve this pick; empty when it may."""
        ...


class Selector(Protocol):
    """Chooses a replica among eligible ones, or leaves the choice to the next selector."""

    def select(self, pick: Pick, routes: Sequence[C]) -> C | None:
        """The route for this pick among ``routes`` (never empty), or None."""
        ...

    def chosen(self, pick: Pick, route: Candidate) -> None:
        """The table gave ``route`` to this pick (whichever selector chose it)."""
        ...

    def forget(self, replica_ids: set[str]) -> None:
        """These replicas left the table."""
        ...
