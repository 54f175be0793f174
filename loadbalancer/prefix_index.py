"""What each replica's prefix cache probably holds, as the balancer sees it: the leading blocks of the prompts
it routed there. I/O-free; the routing table owns one when ``routing_policy`` is ``prefix_aware``.

A prompt's leading ``block_tokens``-token blocks are keyed by :func:`mesh_runtime.prefix.block_keys` (a key
covers every token before it). Routing a request to a replica records its keys there at once, so the
request's siblings that arrive before it has even been prefilled (a GRPO group's ``n`` responses, sent
together) already find them: the placement is predicted, not waited for. Each replica's entries are a least
recently used list bounded by ``capacity_tokens`` (what its engine's KV cache can hold), aged out as the
engine's own LRU would evict them; a replica that leaves the table takes its entries with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class Routed(Protocol):
    """What the policy reads of a route."""

    @property
    def replica_id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def joined_at(self) -> float: ...


R = TypeVar("R", bound=Routed)


class PrefixIndex:
    """Per replica, the block keys it was sent recently, least recently used first."""

    def __init__(self, *, block_tokens: int, capacity_tokens: int, max_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        self.max_blocks = max_blocks
        self._owners: dict[int, set[str]] = {}
        self._replicas: dict[str, OrderedDict[int, None]] = {}

    def blocks(self, replica_id: str) -> int:
        return len(self._replicas.get(replica_id, ()))

    def match(self, keys: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """For each of ``replica_ids``, how many of ``keys`` from the first it holds (absent: none)."""
        candidates = set(replica_ids)
        matched: dict[str, int] = {}
        for depth, key in enumerate(keys, start=1):
            owners = self._owners.get(key)
            if not owners:
                break
            candidates &= owners
            if not candidates:
                break
            for replica_id in candidates:
                matched[replica_id] = depth
        return matched

    def record(self, replica_id: str, keys: Sequence[int]) -> None:
        """``replica_id`` was sent a prompt starting with ``keys``: they are its most recently used."""
        entries = self._replicas.setdefault(replica_id, OrderedDict())
        for key in reversed(keys):           # the head most recent: the tail is evicted first, as engines do
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = None
                self._owners.setdefault(key, set()).add(replica_id)
        while len(entries) > self.capacity_blocks:
            old, _ = entries.popitem(last=False)
            self._drop_owner(old, replica_id)

    def apply(self, replica_id: str, *, reset: bool, stored: Sequence[int], removed: Sequence[int]) -> None:
        """The replica's engine says what it holds: after ``reset`` nothing but ``stored``; ``stored`` keys
        become its most recently used, ``removed`` ones go."""
        if reset:
            self.forget(replica_id)
        entries = self._replicas.setdefault(replica_id, OrderedDict())
        for key in removed:
            if key in entries:
                del entries[key]
                self._drop_owner(key, replica_id)
        self.record(replica_id, stored)

    def forget(self, replica_id: str) -> None:
        """Drop a replica's entries (it left the table, or its cache was emptied)."""
        for key in self._replicas.pop(replica_id, {}):
            self._drop_owner(key, replica_id)

    def _drop_owner(self, key: int, replica_id: str) -> None:
        owners = self._owners.get(key)
        if owners is not None:
            owners.discard(replica_id)
            if not owners:
                del self._owners[key]


class PrefixPolicy:
    """``routing_policy: prefix_aware``: the replica holding most of a prompt's leading blocks, within a load
    gap, else the least loaded; replicas in their warm-up count as more loaded than they are.

    Load is a replica's in-flight requests. The affine replica is taken while its load is at most
    ``least + max(max_load_gap, max_load_ratio * least)``; past that the request spills to the least
    loaded replica, whose index then holds the prompt too (a popular prompt spreads over as many replicas as
    its load needs). A replica that joined ``age < warmup_s`` ago has ``(1 - age / warmup_s)`` times the
    others' mean load added, so a new, empty replica does not take every spill at once.
    """

    def __init__(self, index: PrefixIndex, *, max_load_gap: int, max_load_ratio: float, warmup_s: float) -> None:
        self.index = index
        self.max_load_gap = max_load_gap
        self.max_load_ratio = max_load_ratio
        self.warmup_s = warmup_s

    def loads(self, routes: Sequence[Routed], now: float) -> dict[str, float]:
        """Each route's load as the policy weighs it (warm-up included)."""
        loads = {r.replica_id: float(r.in_flight) for r in routes}
        if self.warmup_s <= 0 or len(routes) < 2:
            return loads
        total = sum(loads.values())
        for route in routes:
            age = now - route.joined_at
            if age < self.warmup_s:
                others = (total - loads[route.replica_id]) / (len(routes) - 1)
                loads[route.replica_id] += (1 - age / self.warmup_s) * others
        return loads

    def affine(self, keys: Sequence[int], routes: Sequence[R], loads: dict[str, float]) -> tuple[R | None, int, bool]:
        """(the route to take for its cached prefix or None, its matched blocks, whether a match was passed
        over for load)."""
        matched = self.index.match(keys, loads)
        if not matched:
            return None, 0, False
        least = min(loads.values())
        allowed = least + max(self.max_load_gap, self.max_load_ratio * least)
        best: R | None = None
        for route in routes:
            depth = matched.get(route.replica_id, 0)
            if depth and loads[route.replica_id] <= allowed and (
                    best is None or (depth, -loads[route.replica_id]) > (matched[best.replica_id],
                                                                         -loads[best.replica_id])):
                best = route
        if best is None:
            return None, 0, True
        return best, matched[best.replica_id], False
