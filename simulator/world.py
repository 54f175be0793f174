"""The simulated hardware and rollout side: engines, load balancer, rollouter and message queue.

Everything here is event-driven on one virtual clock (``World.now``) and
advanced by :class:`~simulator.vloop.VirtualTimeLoop` through
:meth:`World.run_until`. No scheduling decision is made here: which replicas
serve, when they sleep, wake, sync or rebalance is decided by the real
controller core through the simulated ports in :mod:`simulator.ports`.

* **Engines** decode by processor sharing: with ``c`` requests a replica
  produces ``peak x c / (c + c_half)`` tokens/s, split equally, so each
  request advances at ``peak / (c + c_half)`` tokens/s. A request's work is
  its response length plus its prompt's prefill (charged as decode-equivalent
  tokens, ``prompt x peak / prefill_tokens_per_s``). A replica being synced
  is paused (its requests wait); an aborted request resumes on another
  replica with its remaining tokens plus a re-prefill of prompt and generated
  tokens and ``resume_cost_tokens``.
* **Load balancer**: routes each request to the least-loaded routed replica,
  ties broken round robin (known weakness 7); requests aborted on a removed
  replica are resumed elsewhere at once, or parked until a replica is routed.
  ``rebalance`` moves only the excess of over-loaded replicas (weakness 11).
* **Rollouter and queue** follow ``trainer_agent/driver``: GRPO groups of
  ``n`` samples, concurrency ``min(routed x s, max_required_samples)``, the
  staleness budget ``max_required_samples`` per weight version reset by
  :meth:`World.reset_staleness`, no submission while the queue is full, whole
  groups enqueued, oldest groups dropped on overflow and counted.
* **Response lengths** are a fixed trace: the ``i``-th sample ever submitted
  gets the ``i``-th draw, so every policy sees the same workload. The median
  drifts with ``i`` (``growth_per_step`` per step's worth of samples).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections import deque

from mesh_runtime.rollout_metrics import ConcurrencyPoint, rollout_resource_utilization

from .scenario import Engine, Workload


class LengthTrace:
    """Deterministic response lengths by submission index."""

    def __init__(self, workload: Workload, seed: int) -> None:
        self._rng = random.Random(seed)
        r = workload.response_lengths
        self._median, self._sigma, self._max = r.median, r.sigma, r.max_tokens
        self._growth = r.growth_per_step / workload.step_completions
        self._lengths: list[int] = []

    CHUNK = 4096

    def __getitem__(self, index: int) -> int:
        lengths = self._lengths
        while len(lengths) <= index:
            first = len(lengths)
            gauss, exp, sigma, top = self._rng.gauss, math.exp, self._sigma, self._max
            median, growth = self._median, self._growth
            for i in range(first, first + self.CHUNK):
                z = gauss(0.0, 1.0) if sigma > 0 else 0.0
                lengths.append(max(1, min(top, int(round(median * (1.0 + growth * i) * exp(sigma * z))))))
        return lengths[index]


class Replica:
    """One engine replica (processor sharing); see the module docstring."""

    __slots__ = ("index", "replica_id", "node_id", "hybrid", "peak", "c_half", "heap", "served", "t",
                 "version", "routed", "paused")

    def __init__(self, index: int, replica_id: str, node_id: str, hybrid: bool, peak: float,
                 c_half: float) -> None:
        self.index, self.replica_id, self.node_id, self.hybrid = index, replica_id, node_id, hybrid
        self.peak, self.c_half = peak, c_half
        self.heap: list[tuple[float, int]] = []   # (attained-service level at which it finishes, request)
        self.served = 0.0     # tokens every present request has received since it joined, as one level
        self.t = 0.0
        self.version = 0
        self.routed = False
        self.paused = False

    def rate(self) -> float:
        """Tokens/s each request receives now."""
        if self.paused or not self.heap:
            return 0.0
        return self.peak / (len(self.heap) + self.c_half)

    def catch_up(self, now: float) -> None:
        if now > self.t:
            if self.heap and not self.paused:
                self.served += (now - self.t) * self.peak / (len(self.heap) + self.c_half)
            self.t = now


class World:
    """Engines, load balancer, rollouter and queue on one virtual clock."""

    def __init__(self, workload: Workload, engine: Engine, seed: int) -> None:
        self.now = 0.0
        self.workload = workload
        self.engine = engine
        self.trace = LengthTrace(workload, seed)
        self.replicas: list[Replica] = []
        self.by_id: dict[str, Replica] = {}
        self._events: list[tuple[float, int, int, int]] = []
        self._routed: list[Replica] = []
        self._dirty: dict[int, Replica] = {}   # replicas whose next completion must be (re)scheduled
        self._seq = 0
        self._rr = 0
        self._woke = False
        self._prefill_factor = engine.peak_tokens_per_s / engine.prefill_tokens_per_s
        # requests: parallel lists indexed by request id
        self._req_group: list[int] = []
        self._req_len: list[int] = []
        self._req_replica: list[int] = []
        self._orphans: list[tuple[int, float]] = []   # aborted with nowhere to go: (request, work)
        # rollouter
        self.n = workload.n
        self.max_required = workload.max_required_completions
        self.s = engine.concurrent_samples_per_replica
        self.capacity = 0
        self.active = 0
        self.staleness_samples = 0
        self.step_generated = 0
        self._groups_next = 0
        self._group_left: dict[int, int] = {}       # group -> samples not yet completed
        self._group_tokens: dict[int, int] = {}
        self._unsubmitted: deque[list[int]] = deque()   # [group, samples left to submit]
        self._submitted = 0
        self._history: list[list[float]] = []     # [t, active, capacity], compressed
        # queue
        self.queue_bound = workload.queue_bound
        self.queue_size = 0
        self._queue: deque[int] = deque()   # token totals of queued groups (each n samples)
        self.generated = 0
        self.consumed = 0
        self.dropped = 0
        self._waiter: tuple[int, asyncio.Future[None]] | None = None

    # --- building -----------------------------------------------------------------------------

    def add_replica(self, replica_id: str, node_id: str, *, hybrid: bool, routed: bool) -> Replica:
        e = self.engine
        peak = e.peak_tokens_per_s * (e.hybrid_throughput_factor if hybrid else 1.0)
        rep = Replica(len(self.replicas), replica_id, node_id, hybrid, peak, e.half_saturation_concurrency)
        rep.routed = routed
        self.replicas.append(rep)
        self.by_id[replica_id] = rep
        self._routed = [r for r in self.replicas if r.routed]
        return rep

    def start(self) -> None:
        """Open the first rollout window and start generating."""
        self._refresh_capacity()
        self._record()
        self._fill()
        self._flush()

    # --- the event loop's side ----------------------------------------------------------------

    def run_until(self, limit: float) -> bool:
        events, replicas = self._events, self.replicas
        pop = heapq.heappop
        while events:
            t, _, index, version = events[0]
            if t > limit:
                return False
            pop(events)
            rep = replicas[index]
            if version != rep.version:
                continue
            self.now = t
            self._complete_head(rep, t)
            if self._woke:
                self._woke = False
                return True
        return False

    def _flush(self) -> None:
        """Schedule the next completion of every replica whose requests changed."""
        if self._dirty:
            for rep in self._dirty.values():
                self._schedule(rep)
            self._dirty.clear()

    def _schedule(self, rep: Replica) -> None:
        rep.version += 1
        if rep.heap and not rep.paused:
            finish, _ = rep.heap[0]
            rate = rep.peak / (len(rep.heap) + rep.c_half)
            self._seq += 1
            heapq.heappush(self._events, (rep.t + max(0.0, finish - rep.served) / rate, self._seq, rep.index,
                                          rep.version))

    def _complete_head(self, rep: Replica, t: float) -> None:
        finish, req = heapq.heappop(rep.heap)
        rep.served = finish if finish > rep.served else rep.served
        rep.t = t
        self._sample_done(req)
        self._dirty[rep.index] = rep
        self._fill()
        self._flush()

    # --- load balancer ------------------------------------------------------------------------

    def _route(self, req: int, work: float) -> bool:
        """Least in-flight routed replica; ties go round robin, starting after the last one picked."""
        routed = self._routed
        count = len(routed)
        if not count:
            self._orphans.append((req, work))
            return False
        start = self._rr % count
        best, best_load = routed[start], len(routed[start].heap)
        for k in range(start + 1, start + count):
            rep = routed[k - count] if k >= count else routed[k]
            load = len(rep.heap)
            if load < best_load:
                best, best_load = rep, load
        self._rr = routed.index(best) + 1
        best.catch_up(self.now)
        heapq.heappush(best.heap, (best.served + work, req))
        self._req_replica[req] = best.index
        self._dirty[best.index] = best
        return True

    def _route_orphans(self) -> None:
        orphans, self._orphans = self._orphans, []
        for req, work in orphans:
            self._route(req, work)

    def set_routed(self, ids: list[str], routed: bool) -> None:
        for rid in ids:
            self.by_id[rid].routed = routed
        self._routed = [rep for rep in self.replicas if rep.routed]
        if routed:
            self._route_orphans()
        self._refresh_capacity()
        self._fill()
        self._flush()

    def abort(self, ids: list[str]) -> int:
        """Abort every request on these replicas; the load balancer resumes them elsewhere."""
        moved: list[tuple[int, float]] = []
        for rid in ids:
            rep = self.by_id[rid]
            rep.catch_up(self.now)
            for finish, req in rep.heap:
                moved.append((req, self._resume_work(req, finish - rep.served)))
            rep.heap.clear()
            self._dirty[rep.index] = rep
        for req, work in moved:
            self._route(req, work)
        self._flush()
        return len(moved)

    def _resume_work(self, req: int, remaining: float) -> float:
        length = self._req_len[req]
        done = max(0.0, length - remaining)
        prompt = self.workload.prompt_tokens
        return max(0.0, remaining) + (prompt + done) * self._prefill_factor + self.engine.resume_cost_tokens

    def rebalance(self) -> int:
        """Move the excess of over-loaded routed replicas (their newest requests) to the least loaded."""
        routed = [rep for rep in self.replicas if rep.routed]
        if not routed:
            return 0
        total = sum(len(rep.heap) for rep in routed)
        target = math.ceil(total / len(routed))
        moved: list[tuple[int, float]] = []
        for rep in routed:
            excess = len(rep.heap) - target
            if excess <= 0:
                continue
            rep.catch_up(self.now)
            entries = sorted(rep.heap)
            keep, take = entries[:-excess], entries[-excess:]
            heapq.heapify(keep)
            rep.heap = keep
            for finish, req in take:
                moved.append((req, self._resume_work(req, finish - rep.served)))
            self._dirty[rep.index] = rep
        for req, work in moved:
            self._route(req, work)
        self._flush()
        return len(moved)

    def pause(self, ids: list[str], paused: bool) -> None:
        """Stop (weight sync) or restart decoding on these replicas; requests stay in place."""
        for rid in ids:
            rep = self.by_id[rid]
            rep.catch_up(self.now)
            rep.paused = paused
            self._dirty[rep.index] = rep
        self._flush()

    def routed_count(self) -> int:
        return len(self._routed)

    # --- rollouter ----------------------------------------------------------------------------

    def _refresh_capacity(self) -> None:
        cap = min(self.routed_count() * self.s, self.max_required)
        if cap != self.capacity:
            self.capacity = cap
            self._record()

    def _record(self) -> None:
        hist, now = self._history, self.now
        if hist and hist[-1][1] == self.active and hist[-1][2] == self.capacity:
            return
        if hist and hist[-1][0] == now and len(hist) > 1:
            prev = hist[-2]
            if prev[1] == self.active and prev[2] == self.capacity:
                hist.pop()
                return
            hist[-1][1], hist[-1][2] = self.active, self.capacity
            return
        hist.append([now, self.active, self.capacity])

    def _fill(self) -> None:
        n = self.n
        submitted = False
        while self.active < self.capacity and self.queue_size < self.queue_bound:
            if self._unsubmitted:
                entry = self._unsubmitted[0]
                group = entry[0]
                entry[1] -= 1
                if entry[1] == 0:
                    self._unsubmitted.popleft()
            elif self.staleness_samples + n <= self.max_required:
                group = self._groups_next
                self._groups_next += 1
                self.staleness_samples += n
                self._group_left[group] = n
                self._group_tokens[group] = 0
                if n > 1:
                    self._unsubmitted.append([group, n - 1])
            else:
                break
            req = self._submitted
            self._submitted += 1
            self._req_group.append(group)
            length = self.trace[req]
            self._req_len.append(length)
            self._req_replica.append(-1)
            self.active += 1
            submitted = True
            self._route(req, length + self.workload.prompt_tokens * self._prefill_factor)
        if submitted:
            self._record()

    def _sample_done(self, req: int) -> None:
        group = self._req_group[req]
        self.active -= 1
        self._group_tokens[group] += self._req_len[req] + self.workload.prompt_tokens
        left = self._group_left[group] - 1
        if left:
            self._group_left[group] = left
        else:
            del self._group_left[group]
            self.step_generated += 1  # verl's step_generated_samples: fully generated samples (groups)
            self._enqueue(self._group_tokens.pop(group))
        self._record()

    def _enqueue(self, tokens: int) -> None:
        n = self.n
        while self.queue_size + n > self.queue_bound and self._queue:
            self._queue.popleft()
            self.queue_size -= n
            self.dropped += n
        self._queue.append(tokens)
        self.queue_size += n
        self.generated += n
        waiter = self._waiter
        if waiter is not None and self.queue_size >= waiter[0]:
            self._waiter = None
            if not waiter[1].done():
                waiter[1].set_result(None)
                self._woke = True

    def describe(self) -> str:
        return (f"{self.routed_count()} routed replicas, {self.active} requests in flight, "
                f"{self.queue_size} samples queued, staleness budget {self.staleness_samples}/{self.max_required}")

    # --- trainer side -------------------------------------------------------------------------

    async def wait_queue(self, samples: int) -> None:
        """Return once the queue holds at least ``samples``."""
        if self.queue_size >= samples:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = (samples, future)
        try:
            await future
        finally:
            if self._waiter is not None and self._waiter[1] is future:
                self._waiter = None

    def take(self, samples: int) -> int:
        """Consume ``samples`` (whole groups) from the queue; returns their tokens (prompt + response)."""
        groups = samples // self.n
        tokens = 0
        for _ in range(groups):
            tokens += self._queue.popleft()
        self.queue_size -= groups * self.n
        self.consumed += groups * self.n
        self._fill()
        self._flush()
        return tokens

    def reset_staleness(self) -> tuple[list[ConcurrencyPoint], dict[str, float]]:
        """Close the rollout window (section 4.2 history) and open a new staleness budget."""
        self._history.append([self.now, self.active, self.capacity])
        window = [ConcurrencyPoint(t=p[0], active_tasks=int(p[1]), capacity=int(p[2])) for p in self._history]
        util = rollout_resource_utilization(window, 1, max((p.capacity or 0) for p in window))
        metrics = {"dynamic_resource/rollout_resource_utilization": util,
                   "fully_async/rollouter/step_generated_samples": float(self.step_generated)}
        self.step_generated = 0
        self.staleness_samples = self.queue_size + self.n * len(self._group_left)
        self._history = [[self.now, self.active, self.capacity]]
        self._fill()
        self._flush()
        return window, metrics
