"""What each replica's prefix cache probably holds, as the balancer sees it: the leading blocks of the prompts
it routed there. I/O-free; the routing table owns one when ``routing_policy`` is ``prefix_aware`` or
``prefix_cost``.

A prompt's leading blocks are keyed by :func:`mesh_runtime.prefix.block_keys` (a key covers every token
before it), as deep as the prompt goes (or ``max_prefix_tokens``). Each replica is indexed at its own block
size: ``block_tokens`` until its engine's prefix events say what size its cache uses, that size after, so
events are matched whatever block size the engines use and a fleet may mix sizes. A prompt's keys are
computed once per block size in use (:class:`PromptKeys`). Routing a request to a replica records its keys
there at once, so the request's siblings that arrive before it has even been prefilled (a GRPO group's ``n``
responses, sent together) already find them: the placement is predicted, not waited for. Each replica's
entries are a least recently used list bounded by ``capacity_tokens`` (what its engine's KV cache can hold),
aged out as the engine's own LRU would evict them; a replica that leaves the table takes its entries with
it. Memory is bounded by tokens, not by how deep a prompt is: a replica's entries cover at most
``capacity_tokens`` of context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from mesh_runtime.prefix import block_keys


class Routed(Protocol):
    """What the policy reads of a route."""

    @property
    def replica_id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def joined_at(self) -> float: ...


R = TypeVar("R", bound=Routed)


class PromptKeys:
    """A prompt's leading block keys at each block size asked for, each computed once (a request's retries
    and every replica of one block size share them); ``max_tokens`` > 0 stops them at that many tokens."""

    __slots__ = ("tokens", "max_tokens", "_keys")

    def __init__(self, tokens: Sequence[int], max_tokens: int = 0) -> None:
        self.tokens = tokens
        self.max_tokens = max_tokens
        self._keys: dict[int, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def keys(self, size: int) -> list[int]:
        keys = self._keys.get(size)
        if keys is None:
            depth = min(len(self.tokens), self.max_tokens) if self.max_tokens > 0 else len(self.tokens)
            keys = self._keys[size] = block_keys(self.tokens, size, depth // size)
        return keys


class PrefixIndex:
    """Per replica, the block keys it was sent recently, least recently used first, at its block size."""

    def __init__(self, *, block_tokens: int, capacity_tokens: int, max_prefix_tokens: int = 0) -> None:
        self.block_tokens = block_tokens
        """The block size of replicas whose engines said none (predicted entries only)."""
        self.capacity_tokens = capacity_tokens
        self.max_prefix_tokens = max_prefix_tokens
        self._owners: dict[int, set[str]] = {}
        self._replicas: dict[str, OrderedDict[int, None]] = {}
        self._sizes: dict[str, int] = {}

    def prompt(self, tokens: Sequence[int]) -> PromptKeys:
        """``tokens``' keys as this index matches them."""
        return PromptKeys(tokens, self.max_prefix_tokens)

    def block_size(self, replica_id: str) -> int:
        """The block size ``replica_id`` is indexed at."""
        return self._sizes.get(replica_id, self.block_tokens)

    def capacity_blocks(self, replica_id: str) -> int:
        return max(1, self.capacity_tokens // self.block_size(replica_id))

    def blocks(self, replica_id: str) -> int:
        return len(self._replicas.get(replica_id, ()))

    def match(self, prompt: PromptKeys, replica_ids: Iterable[str]) -> dict[str, int]:
        """For each of ``replica_ids``, how many of the prompt's leading tokens it holds, in whole blocks of
        its size (absent: none)."""
        by_size: dict[int, set[str]] = {}
        for replica_id in replica_ids:
            by_size.setdefault(self._sizes.get(replica_id, self.block_tokens), set()).add(replica_id)
        matched: dict[str, int] = {}
        for size, candidates in by_size.items():
            depth = 0
            for key in prompt.keys(size):
                owners = self._owners.get(key)
                if owners is None:
                    break
                if not candidates <= owners:       # some candidates stop here (the common case: none do)
                    held = candidates & owners
                    if not held:
                        break
                    if depth:
                        for replica_id in candidates - held:
                            matched[replica_id] = depth
                    candidates = held
                depth += size
            if depth:
                for replica_id in candidates:
                    matched[replica_id] = depth
        return matched

    def record(self, replica_id: str, prompt: PromptKeys) -> None:
        """``replica_id`` was sent ``prompt``: its keys are its most recently used."""
        self._touch(replica_id, prompt.keys(self.block_size(replica_id)))

    def apply(self, replica_id: str, *, block_tokens: int, reset: bool, stored: Sequence[int],
              removed: Sequence[int]) -> None:
        """The replica's engine says what it holds, in ``block_tokens``-token blocks: after ``reset`` nothing
        but ``stored``; ``stored`` keys become its most recently used, ``removed`` ones go. A block size other
        than the one the replica is indexed at drops its entries and indexes it at the new size."""
        if reset or block_tokens != self.block_size(replica_id):
            self._clear(replica_id)
            self._sizes[replica_id] = block_tokens
        entries = self._replicas.setdefault(replica_id, OrderedDict())
        for key in removed:
            if key in entries:
                del entries[key]
                self._drop_owner(key, replica_id)
        self._touch(replica_id, stored)

    def forget(self, replica_id: str) -> None:
        """Drop a replica (it left the table): its entries and its block size."""
        self._clear(replica_id)
        self._sizes.pop(replica_id, None)

    def _touch(self, replica_id: str, keys: Sequence[int]) -> None:
        entries = self._replicas.setdefault(replica_id, OrderedDict())
        for key in reversed(keys):           # the head most recent: the tail is evicted first, as engines do
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = None
                self._owners.setdefault(key, set()).add(replica_id)
        capacity = self.capacity_blocks(replica_id)
        while len(entries) > capacity:
            old, _ = entries.popitem(last=False)
            self._drop_owner(old, replica_id)

    def _clear(self, replica_id: str) -> None:
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

    def affine(self, prompt: PromptKeys, routes: Sequence[R],
               loads: dict[str, float]) -> tuple[R | None, int, bool]:
        """(the route to take for its cached prefix or None, its matched prompt tokens, whether a match was
        passed over for load)."""
        matched = self.index.match(prompt, loads)
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
