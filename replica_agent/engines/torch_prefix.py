"""The torch engine's prefix cache: KV of token sequences it has computed, reused by later prefills.

A GRPO group sends one prompt ``n`` times and an agentic trajectory resends its whole context every turn,
so most prefill repeats work the engine has done. The cache keeps the keys and values of:

* every prompt right after its prefill (the next request with that prompt, or a longer one starting with
  it, prefills only what follows);
* every finished (or aborted) request's whole sequence, prompt and generated tokens (a trajectory's next
  turn starts with exactly those, then its tool response).

Entries are block-aligned (``block`` tokens; the partial last block is not kept) and indexed by a hash
chain over their blocks, so a lookup finds the longest cached prefix of a context in one pass over its
blocks (tokens are compared, never trusted to the hash). The cache holds at most ``capacity`` tokens,
least recently used first out; an entry unused for ``idle_s`` seconds is dropped, and ``close_session``
drops a session's entries at once. A sequence inserted with ``hold_s`` (a session's turn that ends in a
tool call) is *held* that long: eviction passes over it while an entry nobody holds remains, and takes
the held entry that expires soonest only when every entry is held. The hold ends at its deadline or when a
lookup uses the entry (the session came back). Weights that change make every entry wrong: the engine calls
:meth:`PrefixCache.clear` on every weight swap and release, which starts a new :attr:`generation`; KV
computed under an earlier generation (a row that was running across the swap) is refused by
:meth:`insert`, so no stale entry can come back after a clear.

Not thread-safe: the engine's single worker thread owns it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass
class Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]      # per layer: [kv_heads, len(tokens), head_dim]
    values: list[torch.Tensor]
    session: str
    used: float
    entry_id: int = -1
    held_until: float = 0.0       # on the cache's clock; 0: not held


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted: int = 0
    expired: int = 0
    held: int = 0                 # sequences inserted with a hold
    holds_used: int = 0           # holds a lookup came back to
    holds_evicted: int = 0        # held entries evicted because every entry was held


class PrefixCache:
    """See the module docstring."""

    def __init__(self, capacity: int, *, block: int = 16, idle_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < block or block < 1:
            raise ValueError(f"prefix cache: need capacity >= block >= 1, got {capacity} and {block}")
        self.capacity = capacity
        self.block = block
        self.idle_s = idle_s
        self.clock = clock
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._index: dict[int, int] = {}       # hash chain at a block boundary -> entry id
        self._next_id = 0
        self.tokens = 0
        self.generation = 0
        """Counts clears: KV computed before the last one is of other weights."""

    def _chain(self, tokens: Sequence[int], blocks: int) -> list[int]:
        keys, h = [], 0
        for k in range(blocks):
            h = hash((h, tuple(tokens[k * self.block:(k + 1) * self.block])))
            keys.append(h)
        return keys

    def lookup(self, context: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry holding the longest cached prefix of ``context`` and that prefix's length (a multiple of
        ``block``, always leaving at least one token of ``context`` to prefill)."""
        self._expire()
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(context)
        blocks = (len(context) - 1) // self.block
        best: tuple[Entry | None, int] = (None, 0)
        for k, key in enumerate(self._chain(context, blocks), start=1):
            entry_id = self._index.get(key)
            if entry_id is None:
                break
            entry = self._entries.get(entry_id)
            length = k * self.block
            if entry is None or entry.tokens[:length] != tuple(context[:length]):
                break
            best = (entry, length)
        entry, length = best
        if entry is not None:
            self.stats.hits += 1
            self.stats.hit_tokens += length
            if entry.held_until:
                entry.held_until = 0.0
                self.stats.holds_used += 1
            self._touch(entry)
        return best

    def insert(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               session: str = "", generation: int | None = None, hold_s: float = 0.0) -> None:
        """Keep the KV of ``tokens`` (per layer ``[kv_heads, len(tokens), head_dim]``, copied here), computed
        under ``generation`` (None: the current one), held for ``hold_s`` seconds when > 0; KV of an earlier
        generation is not kept."""
        n = (len(tokens) // self.block) * self.block
        if n == 0 or n > self.capacity or (generation is not None and generation != self.generation):
            return
        self._expire()
        chain = self._chain(tokens, n // self.block)
        known = self._entries.get(self._index.get(chain[-1], -1))
        if known is not None and known.tokens == tuple(tokens[:n]):
            known.session = known.session or session
            self._hold(known, hold_s)
            self._touch(known)
            return
        entry_id = self._next_id
        entry = Entry(tuple(tokens[:n]), [k[:, :n].clone() for k in keys], [v[:, :n].clone() for v in values],
                      session, self.clock(), entry_id)
        self._next_id += 1
        self._hold(entry, hold_s)
        self._entries[entry_id] = entry
        for key in chain:
            self._index[key] = entry_id
        self.tokens += n
        while self.tokens > self.capacity:
            self._remove(self._victim())
            self.stats.evicted += 1

    def _hold(self, entry: Entry, hold_s: float) -> None:
        if hold_s > 0:
            entry.held_until = max(entry.held_until, self.clock() + hold_s)
            self.stats.held += 1

    def _victim(self) -> int:
        """The least recently used entry nobody holds; when all are held, the one whose hold ends soonest."""
        now = self.clock()
        for entry_id, entry in self._entries.items():
            if entry.held_until <= now:
                return entry_id
        self.stats.holds_evicted += 1
        return min(self._entries.values(), key=lambda e: e.held_until).entry_id

    def close_session(self, session: str) -> bool:
        """Drop a session's entries; whether there were any."""
        doomed = [i for i, e in self._entries.items() if session and e.session == session]
        for entry_id in doomed:
            self._remove(entry_id)
        return bool(doomed)

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._index.clear()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _touch(self, entry: Entry) -> None:
        entry.used = self.clock()
        self._entries.move_to_end(entry.entry_id)

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            entry_id, entry = next(iter(self._entries.items()))
            if now - entry.used <= self.idle_s:
                break
            self._remove(entry_id)
            self.stats.expired += 1

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.tokens -= len(entry.tokens)
        for key in self._chain(entry.tokens, len(entry.tokens) // self.block):
            if self._index.get(key) == entry_id:
                del self._index[key]
