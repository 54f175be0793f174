"""A cost model of one GPU inference engine: what prefill, decode and a prefix cache cost, and when KV runs out.

Used by the synthetic backend (``engine_options: {engine_model: {...}}``) and by the benchmarks' fake SGLang
worker, so rollmesh's balancer and a peer router are measured on the same engine. Pure Python, no I/O, no
clock: callers ask what a step costs and sleep that long.

* **Prefix cache.** The KV of full ``block_size``-token blocks, keyed by a hash chain over the tokens
  (:func:`mesh_runtime.prefix.block_keys`), so a block is shared by every request whose context starts with
  the same tokens. A request's prompt blocks enter the cache when it is admitted (its siblings admitted later
  reuse them) and its generated blocks when it ends (a trajectory's next turn starts with them). Blocks no
  running request uses stay cached and are evicted least recently used when room is needed, a sequence's last
  blocks first (as vLLM frees them). At least one prompt token is always computed, as in vLLM.
* **KV capacity.** ``kv_capacity_tokens`` in blocks, allocated one of two ways. By default admission needs
  room for the uncached prompt blocks and the request's ``max_tokens``, reserved up front, so a running request
  never runs out. With ``preempt`` (as vLLM does) admission needs room for the uncached prompt blocks and the
  first step's tokens only, and the blocks of later tokens are allocated step by step (:meth:`EngineModel.grow`);
  when they run out, the most recently admitted running request is preempted: its blocks are freed (its full
  ones stay cached until evicted) and it waits to be admitted again, recomputing what is no longer cached.
  Either way cached blocks nobody uses are evicted to make room, and a request that still does not fit waits.
  ``max_prefill_tokens`` bounds the uncached prompt tokens admitted per decode iteration (chunked prefill's
  token budget); one request always fits.
* **Holds across a pause.** A request that ends with ``hold_s`` > 0 (a trajectory's turn that ends in a tool
  call) keeps its sequence's blocks pinned for that long after it ends: other requests' admissions evict
  every block nobody holds before one a paused trajectory will come back for. The hold ends when the
  session's next request is admitted (its blocks are then that request's), at its deadline, when the
  session is closed, or under pressure: an admission that finds no room otherwise releases holds, the
  soonest to expire first, before it waits.
* **Time.** A step of ``k`` decode iterations over a batch of ``B`` requests with contexts ``c_i`` costs
  ``k * (decode_step_s + B * decode_per_seq_s) + decode_per_context_token_s * sum over the k iterations of the
  batch's context tokens``, plus the uncached prompt tokens of the requests it admits over
  ``prefill_tokens_per_s``; all divided by ``speed`` (1: the modelled GPU; 0.25: four times slower, for runs on
  CPUs that route slower than a GPU generates).

The defaults model Llama-3.1-8B in bf16 on one H100 SXM under vLLM; docs/load-balancer.md's "Engine model" section
derives each from the GPU's and the model's published figures and checks the result against published
vLLM throughput.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

from mesh_runtime.prefix import block_keys

from .errors import InvalidRequest

HIT_WINDOW = 256
"""Admissions the reported hit rate covers (the most recent ones)."""


@dataclasses.dataclass
class EngineModelConfig:
    """Costs and capacities of the modelled engine (defaults: Llama-3.1-8B bf16, one H100 SXM, vLLM)."""

    speed: float = 1.0
    """Every duration is divided by this: 1 is the modelled GPU, 0.25 runs four times slower."""
    decode_step_s: float = 0.0062
    """Fixed cost of one decode iteration: the 16.06 GB of weights read at 77% of 3.35 TB/s."""
    decode_per_seq_s: float = 10e-6
    """Added per running request per iteration (sampling, scheduling, launch overheads)."""
    decode_per_context_token_s: float = 51e-9
    """Added per context token of the batch per iteration: its 128 KiB of KV read at 77% of 3.35 TB/s."""
    prefill_tokens_per_s: float = 30_000.0
    """Uncached prompt tokens computed per second: 16.1 GFLOP a token at half of 989 TFLOPS."""
    kv_capacity_tokens: int = 400_000
    """KV cache size in tokens: 0.9 of 80 GB less weights and activations, at 128 KiB a token."""
    block_size: int = 16
    """Tokens per KV block (vLLM's default); only full blocks are cached."""
    max_prefill_tokens: int = 8192
    """Uncached prompt tokens admitted per decode iteration (chunked prefill's budget; one request always
    fits)."""
    preempt: bool = False
    """False: a request reserves the KV of its ``max_tokens`` when admitted; True: KV is allocated as tokens are
    generated and, when it runs out, the most recently admitted running request is preempted and recomputed
    later (vLLM's scheduler)."""

    def validate(self) -> None:
        for name in ("speed", "prefill_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"engine_model: {name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_step_s", "decode_per_seq_s", "decode_per_context_token_s"):
            if not getattr(self, name) >= 0:
                raise InvalidRequest(f"engine_model: {name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1 or self.max_prefill_tokens < 1:
            raise InvalidRequest("engine_model: block_size and max_prefill_tokens must be >= 1")
        if not isinstance(self.preempt, bool):
            raise InvalidRequest(f"engine_model: preempt must be true or false, got {str(self.preempt)[:32]!r}")
        if self.kv_capacity_tokens < self.block_size:
            raise InvalidRequest(f"engine_model: kv_capacity_tokens must hold a block, got {self.kv_capacity_tokens}")


class PrefixEvents:
    """What a prefix cache tells subscribers (the agent's ``WatchPrefixCache``): keys of blocks stored and
    removed, and resets (new weights: nothing cached is valid). A subscriber gets a snapshot first."""

    def __init__(self, block_tokens: int, snapshot: Callable[[], list[int]]) -> None:
        self.block_tokens = block_tokens
        self._snapshot = snapshot
        self._queues: dict[asyncio.Queue, str] = {}

    @property
    def watched(self) -> bool:
        return bool(self._queues)

    def subscribe(self, queue: asyncio.Queue, tag: str) -> None:
        """Put ``(tag, reset, stored, removed)`` on ``queue`` for every change, starting with
        ``(tag, True, every cached key, [])``."""
        queue.put_nowait((tag, True, self._snapshot(), []))
        self._queues[queue] = tag

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._queues.pop(queue, None)

    def publish(self, reset: bool, stored: list[int], removed: list[int]) -> None:
        for queue, tag in self._queues.items():
            queue.put_nowait((tag, reset, stored, removed))


class BlockCache:
    """Blocks by key: pinned ones (used by running requests, with a count) and idle ones (LRU order)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.pinned: dict[int, int] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evicted = 0
        self.stored: list[int] = []
        """Keys that entered the cache since the owner last took them (for :class:`PrefixEvents`)."""
        self.removed: list[int] = []
        """Keys that left it."""

    def __len__(self) -> int:
        return len(self.pinned) + len(self.idle)

    def __contains__(self, key: int) -> bool:
        return key in self.pinned or key in self.idle

    def matched(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` from the first are cached."""
        for count, key in enumerate(keys):
            if key not in self.pinned and key not in self.idle:
                return count
        return len(keys)

    def pin(self, key: int) -> None:
        if key in self.idle:
            del self.idle[key]
            self.pinned[key] = 1
        elif key in self.pinned:
            self.pinned[key] += 1
        else:
            self.pinned[key] = 1
            self.stored.append(key)

    def add_idle(self, key: int) -> None:
        self.idle[key] = None
        self.stored.append(key)

    def unpin(self, key: int, keep: bool = True) -> None:
        """One user fewer; a block nobody uses stays cached (most recently used) when ``keep``, else goes
        (a block of replaced weights: subscribers forgot it at the reset)."""
        left = self.pinned[key] - 1
        if left:
            self.pinned[key] = left
        else:
            del self.pinned[key]
            if keep:
                self.idle[key] = None

    def make_room(self, blocks: int, reserved: int) -> bool:
        """Evict idle blocks until ``blocks`` more fit beside the cached ones and ``reserved`` others."""
        while len(self) + reserved + blocks > self.capacity and self.idle:
            key, _ = self.idle.popitem(last=False)
            self.removed.append(key)
            self.evicted += 1
        return len(self) + reserved + blocks <= self.capacity


@dataclasses.dataclass
class _Held:
    keys: list[int]         # the prompt's full blocks, pinned while the request runs
    stale: bool             # admitted under weights since replaced: its blocks are not kept
    private_blocks: int     # for the partial prompt block and generated tokens (max_tokens' worth if reserved)
    context: int            # tokens of context now (prompt + generated so far)


@dataclasses.dataclass
class _Hold:
    keys: list[int]         # the blocks pinned for the session's next request
    until: float            # on the caller's clock


@dataclasses.dataclass
class HoldStats:
    held: int = 0           # requests that ended with a hold
    used: int = 0           # holds the session's next request came back to
    expired: int = 0
    released: int = 0       # given up under pressure


class EngineModel:
    """One engine's prefix cache, KV reservations and step costs; see the module docstring."""

    def __init__(self, config: EngineModelConfig | None = None, *, iterations_per_step: int = 1,
                 clock: Callable[[], float] | None = None) -> None:
        """``iterations_per_step``: decode iterations a caller's step stands for (the prefill budget of a step
        is ``max_prefill_tokens`` per iteration). ``clock``: what holds' deadlines are on (without one, a
        hold lasts until used, closed or released under pressure)."""
        self.config = config or EngineModelConfig()
        self.config.validate()
        self.iterations_per_step = iterations_per_step
        self.blocks = BlockCache(self.config.kv_capacity_tokens // self.config.block_size)
        self._held: dict[str, _Held] = {}
        self._private = 0
        self._prefill = 0                       # uncached prompt tokens admitted since the last step
        self._generation = 0                    # bumped by clear(): renames blocks of earlier weights
        self.events = PrefixEvents(self.config.block_size, lambda: [*self.blocks.pinned, *self.blocks.idle])
        """Published as blocks come and go (the agent streams them to balancers that route by prefix)."""
        self._step_budget = self.config.max_prefill_tokens * iterations_per_step
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=HIT_WINDOW)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._clock = clock
        self._holds: dict[str, _Hold] = {}
        self._hold_pins: collections.Counter[int] = collections.Counter()
        """Per block, the pins of holds on it."""
        self.hold_stats = HoldStats()
        self.preemptions = 0
        """Running requests preempted for KV so far (``preempt`` only)."""

    # ----------------------------------------------------------------- requests
    def admit(self, request_id: str, context: Sequence[int], max_tokens: int, session: str = "") -> int | None:
        """Admit a request: its cached prompt tokens, or ``None`` when it must wait (KV or prefill budget).
        The session's hold, if any, ends once the request is admitted (its blocks are the request's then)."""
        self._expire_holds()
        size = self.config.block_size
        keys = block_keys(context, size)
        usable = (len(context) - 1) // size         # the last prompt token is always computed
        hit = self.blocks.matched(keys[:usable])
        uncached = len(context) - hit * size
        if self._prefill and uncached > self._step_budget:
            return None
        ahead = min(max_tokens, self.iterations_per_step) if self.config.preempt else max_tokens
        private = math.ceil((len(context) - len(keys) * size + ahead) / size)
        for key in keys[:hit]:
            self.blocks.pin(key)
        while not self.blocks.make_room(len(keys) - hit, self._private + private):
            if not self._release_a_hold(but=session):
                for key in reversed(keys[:hit]):
                    self.blocks.unpin(key)
                return None
        for key in keys[hit:]:
            self.blocks.pin(key)
        if session in self._holds:
            self.hold_stats.used += 1
            self._end_hold(session)
        self._private += private
        self._held[request_id] = _Held(keys, False, private, len(context))
        self._prefill += uncached
        self._step_budget -= uncached
        self._recent.append((len(context), hit * size))
        self.prompt_tokens += len(context)
        self.cached_tokens += hit * size
        self._publish()
        return hit * size

    def grow(self, runs: Sequence[tuple[str, int]], sequence_of: Callable[[str], Sequence[int]]) -> list[str]:
        """Before a step in which each ``(request id, tokens)`` row decodes that many tokens, allocate the blocks
        those tokens need (with ``preempt``; otherwise they were reserved at admission). Rows are served in
        the order they were admitted; where blocks run out after evicting idle ones and releasing holds, the
        most recently admitted rows are preempted: released (``sequence_of(id)``'s full blocks cached) and
        returned, in that order, to be admitted again later. A row preempted to make room for itself ends
        the allocation."""
        if not self.config.preempt:
            return []
        self._expire_holds()
        size = self.config.block_size
        tokens = dict(runs)
        order = [request_id for request_id in self._held if request_id in tokens]
        preempted: list[str] = []
        index = 0
        while index < len(order):
            held = self._held[order[index]]
            need = -(-(held.context + tokens[order[index]]) // size) - len(held.keys) - held.private_blocks
            while need > 0 and not self.blocks.make_room(need, self._private):
                if self._release_a_hold(but=""):
                    continue
                victim = order.pop()
                self.release(victim, sequence_of(victim))
                preempted.append(victim)
                self.preemptions += 1
                if len(order) == index:     # the row itself was the most recent
                    break
            else:
                if need > 0:
                    held.private_blocks += need
                    self._private += need
                index += 1
        return preempted

    def release(self, request_id: str, sequence: Sequence[int] = (), *, session: str = "",
                hold_s: float = 0.0) -> None:
        """A request left (finished or aborted): unpin its blocks and cache ``sequence``'s (its prompt and the
        tokens it generated) for whoever continues it; with ``session`` and ``hold_s`` > 0, keep them pinned
        for the session's next request that long (see the module docstring)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._private -= held.private_blocks
        size = self.config.block_size
        current = not held.stale
        longer = current and len(sequence) // size > len(held.keys)
        new = block_keys(sequence, size)[len(held.keys):] if longer else []
        for key in reversed(new):       # freed tail first, so the tail is evicted first (as vLLM frees blocks)
            if key not in self.blocks and self.blocks.make_room(1, self._private):
                self.blocks.add_idle(key)
        for key in reversed(held.keys):
            self.blocks.unpin(key, keep=current)
        if session and hold_s > 0 and current:
            self._hold(session, [*held.keys, *new], hold_s)
        self._publish()

    def close_session(self, session: str) -> bool:
        """The session ended: its hold, if any, ends now (its blocks stay cached, unpinned)."""
        return self._end_hold(session)

    @property
    def held_sessions(self) -> int:
        return len(self._holds)

    def _hold(self, session: str, keys: list[int], hold_s: float) -> None:
        self._end_hold(session)
        kept = [key for key in keys if key in self.blocks]
        for key in kept:
            self.blocks.pin(key)
        self._hold_pins.update(kept)
        until = self._clock() + hold_s if self._clock is not None else math.inf
        self._holds[session] = _Hold(kept, until)
        self.hold_stats.held += 1

    def _end_hold(self, session: str) -> bool:
        hold = self._holds.pop(session, None)
        if hold is None:
            return False
        for key in reversed(hold.keys):
            self.blocks.unpin(key)
        self._hold_pins.subtract(hold.keys)
        for key in hold.keys:
            if self._hold_pins[key] <= 0:
                del self._hold_pins[key]
        return True

    def _expire_holds(self) -> None:
        if not self._holds or self._clock is None:
            return
        now = self._clock()
        for session in [s for s, h in self._holds.items() if h.until <= now]:
            self._end_hold(session)
            self.hold_stats.expired += 1

    def _release_a_hold(self, but: str) -> bool:
        """Under pressure: end the hold that would expire soonest (not ``but``'s); whether there was one."""
        victims = [(h.until, s) for s, h in self._holds.items() if s != but]
        if not victims:
            return False
        self._end_hold(min(victims)[1])
        self.hold_stats.released += 1
        return True

    def clear(self) -> None:
        """New weights make cached KV wrong: holds end and idle blocks go; blocks running requests hold are
        renamed (never matched again) and go when those requests end."""
        for session in list(self._holds):
            self._end_hold(session)
        self.blocks.idle.clear()
        self._generation += 1
        stale = {key: hash(("stale", self._generation, key)) for key in self.blocks.pinned}
        self.blocks.pinned = {stale[key]: count for key, count in self.blocks.pinned.items()}
        for held in self._held.values():
            held.keys = [stale[key] for key in held.keys]
            held.stale = True
        self.blocks.stored.clear()
        self.blocks.removed.clear()
        if self.events.watched:
            self.events.publish(True, [], [])

    def _publish(self) -> None:
        blocks = self.blocks
        if (blocks.stored or blocks.removed) and self.events.watched:
            self.events.publish(False, blocks.stored, blocks.removed)
            blocks.stored, blocks.removed = [], []
        else:
            blocks.stored.clear()
            blocks.removed.clear()

    # --------------------------------------------------------------------- time
    def step_seconds(self, runs: Sequence[tuple[str, int]]) -> float:
        """Cost of one step in which each ``(request id, tokens)`` row decodes that many tokens, plus the
        prefill of the requests admitted since the last step; the rows' contexts grow by their tokens."""
        c = self.config
        iterations = max((n for _, n in runs), default=0)
        rows = len(runs)
        context = 0
        for request_id, tokens in runs:
            held = self._held.get(request_id)
            if held is not None:
                context += held.context
                held.context += tokens
        seconds = (iterations * (c.decode_step_s + rows * c.decode_per_seq_s + c.decode_per_context_token_s * context)
                   + c.decode_per_context_token_s * rows * iterations * (iterations - 1) / 2
                   + self._prefill / c.prefill_tokens_per_s)
        self._prefill = 0
        self._step_budget = c.max_prefill_tokens * self.iterations_per_step
        return seconds / c.speed

    # ------------------------------------------------------------------ reports
    @property
    def cache_tokens(self) -> int:
        """Tokens whose KV is cached (in use or idle)."""
        return len(self.blocks) * self.config.block_size

    @property
    def used_tokens(self) -> int:
        """KV in use by running requests: their prompt blocks and their reservations (blocks only holds pin
        are not: they are given up under pressure)."""
        only_held = sum(1 for key, count in self._hold_pins.items() if self.blocks.pinned.get(key, 0) <= count)
        return (len(self.blocks.pinned) - only_held + self._private) * self.config.block_size

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the last :data:`HIT_WINDOW` admissions (0 before any)."""
        prompts = sum(p for p, _ in self._recent)
        return sum(h for _, h in self._recent) / prompts if prompts else 0.0
