"""Request lifecycle shared by step-driven engines.

``SteppedEngine`` owns everything that does not depend on how tokens are
produced: admission into the running batch, streaming chunks (coalesced by
size and time, :mod:`.chunking`), stop/length checks, abort, pause,
sleep/wake bookkeeping, atomic weight-load sequencing, weight-version
segments and load metrics. A backend supplies one coroutine,
:meth:`SteppedEngine._execute_step`, that produces one token for every row of
the batch (or, with :attr:`SteppedEngine.multi_token_steps`, a run of tokens
per row), plus hooks for loading and (off)loading weights.

One background task (the decode loop) runs steps back to back while there is
work. Between steps it admits waiting requests (first-come first-served,
within ``max_batch_size`` and the ``max_total_tokens`` reservation) and
retires finished or aborted ones, so requests join and leave the batch at
iteration granularity.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .base import WAKE_TAGS, Engine, LifecycleFlags, PauseMode
from .chunking import DEFAULT_FLUSH_INTERVAL_S, ChunkBuffer
from .errors import DuplicateRequest, EngineDead, EngineUnavailable, InvalidRequest
from .metrics import EngineMetrics
from .request_state import ActiveRequest, StepBatch
from .types import (
    FinishReason,
    GenerationChunk,
    EngineRequest,
    LoadSnapshot,
    Usage,
    validate_request,
)

log = logging.getLogger(__name__)

ABORT_WAIT_S = 60.0
"""Upper bound on how long ``abort()`` waits for the loop to retire a request."""


class SteppedEngine(LifecycleFlags, Engine):
    """Engine base class driven by a single decode loop of batched steps."""

    multi_token_steps = False
    """True: ``_execute_step`` returns ``(token_ids, logprobs)`` lists per row, a run of tokens each (the
    synthetic engine's chunked steps); False: one ``(token_id, logprob)`` per row."""

    def __init__(
        self,
        *,
        replica_id: str = "",
        node_id: str = "",
        stream_interval: int = 16,
        flush_interval_s: float | None = DEFAULT_FLUSH_INTERVAL_S,
        max_batch_size: int = 256,
        max_total_tokens: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stream_interval < 1:
            raise InvalidRequest(f"stream_interval must be >= 1, got {stream_interval}")
        if flush_interval_s is not None and flush_interval_s < 0:
            raise InvalidRequest(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        if max_batch_size < 1:
            raise InvalidRequest(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.replica_id = replica_id
        self.node_id = node_id
        self.stream_interval = stream_interval
        self.flush_interval_s = flush_interval_s
        self.max_batch_size = max_batch_size
        self.max_total_tokens = max_total_tokens
        self._clock = clock
        self._metrics = EngineMetrics(clock)
        self._requests: dict[str, ActiveRequest] = {}
        self._waiting: collections.deque[ActiveRequest] = collections.deque()
        self._running: list[ActiveRequest] = []
        self._dropped: list[str] = []
        self._holds: dict[str, float] = {}
        """Of ``_dropped``, requests that finished asking their session's KV held (request id -> seconds)."""
        self._reserved = 0
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._step_lock = asyncio.Lock()
        self._in_step = False
        self._loop_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self._dead: BaseException | None = None
        self._paused = False
        self._weights_resident = True
        self._weights_loaded = True
        self._kv_resident = True
        self._weight_version = 0
        self.step_count = 0
        """Decode-loop iterations run so far (a step prefills joiners and decodes the rest)."""

    # ----------------------------------------------------------- backend hooks
    @abc.abstractmethod
    async def _load_model(self) -> None:
        """Build or load the model (called once by ``start``)."""

    @abc.abstractmethod
    async def _unload_model(self) -> None:
        """Release the model (called once by ``close``)."""

    @abc.abstractmethod
    def _request_limits(self) -> dict[str, int | None]:
        """Keyword limits for :func:`validate_request` (vocab_size, max_model_len)."""

    @abc.abstractmethod
    def _eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation unless ``ignore_eos`` is set."""

    @abc.abstractmethod
    async def _execute_step(self, batch: StepBatch) -> list[Any]:
        """Run one step; return ``(token_id, logprob)`` for ``batch.running``
        followed by ``batch.admitted``, in order (``(token_ids, logprobs)`` lists
        when :attr:`multi_token_steps`)."""

    @abc.abstractmethod
    async def _reset_batch(self) -> None:
        """Forget every row of the batch (all requests have been retired)."""

    async def _retire_batch(self, holds: dict[str, float]) -> None:
        """Every row of the batch finished: forget them (an engine with a prefix cache keeps their KV, holding
        ``holds``' for their sessions that many seconds)."""
        await self._reset_batch()

    @abc.abstractmethod
    async def _release_weights(self, level: int) -> int:
        """Level 1: move resident weights to host memory. Level 2: discard
        resident weights and any host copy. Return the bytes freed."""

    @abc.abstractmethod
    async def _restore_weights(self) -> bool:
        """Make weights resident again; return True if their contents came
        back (from a level-1 host copy), False if they are uninitialised."""

    @abc.abstractmethod
    def _check_weights(self, named_tensors: Mapping[str, Any], require_complete: bool) -> None:
        """Raise ``WeightMismatch`` unless ``named_tensors`` fit the model."""

    @abc.abstractmethod
    async def _flush_cache(self) -> None:
        """Drop the cached prefixes (between steps)."""

    @abc.abstractmethod
    async def _swap_weights(self, named_tensors: Mapping[str, Any]) -> None:
        """Install already-checked tensors (called between steps)."""

    def _reserve(self, active: ActiveRequest) -> bool:
        """Claim KV for a request about to join the batch; False: it must wait. By default its prompt and
        ``max_tokens`` count against ``max_total_tokens``; an engine with a prefix cache counts what it shares
        (and sets ``active.cached_tokens``)."""
        if self._reserved + active.reserved_tokens > self.max_total_tokens:
            return False
        self._reserved += active.reserved_tokens
        return True

    def _unreserve(self, active: ActiveRequest) -> None:
        """Give back what :meth:`_reserve` claimed (the request left the batch)."""
        self._reserved -= active.reserved_tokens

    def _grow(self, running: list[ActiveRequest]) -> list[ActiveRequest]:
        """Before a step, find KV for the running requests' next tokens; returns those preempted to make room
        (their KV given back; they wait to be admitted again). By default none: :meth:`_reserve` claimed all
        a request can use."""
        return []

    def _discard(self, active: ActiveRequest) -> None:
        """A preempted request left while waiting to be admitted again: forget what was kept to resume it."""

    def _default_seed(self, request: EngineRequest) -> int:
        """Sampling seed of a request that brings none (random by default)."""
        return secrets.randbits(63)

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise EngineDead("engine is closed")
        try:
            await self._load_model()
        except BaseException as exc:
            self._dead = exc
            raise
        self._started = True
        self._loop_task = asyncio.create_task(self._decode_loop(), name=f"decode-loop-{self.replica_id}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._requests:
            await self.abort(None)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        async with self._step_lock:
            if self._started:
                await self._reset_batch()
            await self._unload_model()

    # ------------------------------------------------------------- generation
    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationChunk]:
        active = self._submit(request)
        chunks = self._chunks(active.out.queue, lambda: self._abort_nowait(active))
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _submit(self, request: EngineRequest) -> ActiveRequest:
        self._check_alive()
        validate_request(request, max_total_tokens=self.max_total_tokens, **self._request_limits())
        self._check_serving()
        if request.request_id in self._requests:
            raise DuplicateRequest(f"request {request.request_id} is already in flight")
        seed = request.sampling.seed
        if seed is None:
            seed = self._default_seed(request)
        sampling = request.sampling
        enders = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            enders |= self._eos_token_ids()
        out = ChunkBuffer.for_request(request, stream_interval=self.stream_interval,
                                      flush_interval_s=self.flush_interval_s, replica_id=self.replica_id,
                                      node_id=self.node_id)
        active = ActiveRequest(_private_copy(request), seed, self._clock(), out, enders)
        self._requests[request.request_id] = active
        self._waiting.append(active)
        self._idle.clear()
        self._work.set()
        return active

    async def abort(self, request_ids: list[str] | None = None) -> list[str]:
        if request_ids is None:
            targets = list(self._requests.values())
        else:
            targets = [self._requests[i] for i in request_ids if i in self._requests]
        for active in targets:
            self._abort_nowait(active)
        pending = [a.done.wait() for a in targets if not a.done.is_set()]
        if pending:
            try:
                await asyncio.wait_for(asyncio.gather(*pending), ABORT_WAIT_S)
            except TimeoutError:
                log.warning("abort: %d request(s) not retired within %.0f s", len(pending), ABORT_WAIT_S)
        return [a.request_id for a in targets]

    def _abort_nowait(self, active: ActiveRequest) -> None:
        """Mark ``active`` aborted; retire it now unless a step is using it."""
        if active.finish_reason is not None or active.done.is_set():
            return
        active.abort_requested = True
        if active in self._waiting or not self._in_step:
            self._finish(active, FinishReason.ABORTED)

    # ------------------------------------------------------------ decode loop
    def _can_admit(self) -> bool:
        return bool(self._waiting) and self._weights_resident and self._kv_resident and self._weights_loaded

    async def _decode_loop(self) -> None:
        try:
            while True:
                if not (self._running or self._can_admit()):
                    if self._dropped:
                        async with self._step_lock:  # free the retired rows' cache now
                            if not self._running:
                                self._dropped = []
                                holds, self._holds = self._holds, {}
                                await self._retire_batch(holds)
                        continue
                    self._work.clear()
                    await self._work.wait()
                    continue
                async with self._step_lock:
                    if not (self._running or self._can_admit()):
                        continue
                    rows, batch = self._plan_step()
                    version = self._weight_version
                    self._in_step = True
                    try:
                        tokens = await self._execute_step(batch)
                    finally:
                        self._in_step = False
                    self.step_count += 1
                self._apply_step(rows, tokens, version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure kills the engine
            log.exception("decode loop of replica %r failed", self.replica_id)
            self._fail(exc)

    def _plan_step(self) -> tuple[list[ActiveRequest], StepBatch]:
        preempted = self._grow(list(self._running)) if self._running else []
        for active in preempted:        # back to the head of the queue, in their order (as vLLM does)
            self._running.remove(active)
            self._dropped.append(active.request_id)
            active.preemptions += 1
        self._waiting.extendleft(reversed(preempted))
        running = list(self._running)
        admitted: list[ActiveRequest] = []
        if self._weights_resident and self._kv_resident and self._weights_loaded and not preempted:
            now = self._clock()
            while self._waiting and len(running) + len(admitted) < self.max_batch_size:
                head = self._waiting[0]
                if not self._reserve(head):
                    break
                self._waiting.popleft()
                if head.admitted_at is None:
                    self._metrics.record_queue_time(now - head.submitted_at)
                head.admitted_at = now
                admitted.append(head)
        self._running.extend(admitted)
        dropped, self._dropped = self._dropped, []
        holds, self._holds = self._holds, {}
        batch = StepBatch(
            dropped=dropped,
            holds=holds,
            running=[a.row(with_context=False) for a in running],
            admitted=[a.row(with_context=True) for a in admitted],
        )
        return running + admitted, batch

    def _apply_step(self, rows: list[ActiveRequest], tokens: list[Any], version: int) -> None:
        if len(tokens) != len(rows):
            raise RuntimeError(f"backend returned {len(tokens)} tokens for {len(rows)} rows")
        now = self._clock()
        emitted = 0
        multi = self.multi_token_steps
        for active, produced in zip(rows, tokens):
            if active.finish_reason is not None:
                continue
            if multi:
                token_ids, logprobs = produced
            else:
                token_ids, logprobs = [produced[0]], [produced[1]]
            emitted += self._append(active, token_ids, logprobs, version, now)
        self._metrics.record_tokens(emitted)

    def _append(self, active: ActiveRequest, token_ids: list[int], logprobs: list[float], version: int,
                now: float) -> int:
        """Take a row's new tokens up to its end (a stop token, ``max_tokens``); finish it or flush what is
        due. Returns the number of tokens taken."""
        sp = active.request.sampling
        room = sp.max_tokens - active.completion_tokens
        if len(token_ids) > room:
            token_ids, logprobs = token_ids[:room], logprobs[:room]
        reason: FinishReason | None = None
        enders = active.enders
        if enders:
            for index, token in enumerate(token_ids):
                if token in enders:
                    token_ids, logprobs = token_ids[:index + 1], logprobs[:index + 1]
                    reason = FinishReason.STOP
                    break
        if not token_ids:
            return 0
        active.out.add(token_ids, logprobs if sp.logprobs else [], version, now)
        if active.last_token_at is None:
            self._metrics.record_ttft(now - active.submitted_at)
        else:
            self._metrics.record_itl((now - active.last_token_at) / len(token_ids))
        active.last_token_at = now
        if reason is None and active.completion_tokens >= sp.max_tokens:
            reason = FinishReason.LENGTH
        elif reason is None and active.abort_requested:
            reason = FinishReason.ABORTED
        if reason is not None:
            self._finish(active, reason)
        else:
            active.out.flush_due(now)
        return len(token_ids)

    def _finish(self, active: ActiveRequest, reason: FinishReason) -> None:
        """Send the final chunk and retire ``active`` from every queue."""
        usage = Usage(
            prompt_tokens=len(active.request.prompt_token_ids),
            completion_tokens=active.completion_tokens,
            resumed_tokens=len(active.prefix),
            cached_tokens=active.cached_tokens,
        )
        active.out.finish(reason, usage, active.request.resume_segments, self._weight_version)
        active.finish_reason = reason
        self._retire(active)

    def _retire(self, active: ActiveRequest) -> None:
        self._requests.pop(active.request_id, None)
        if active in self._running:
            self._running.remove(active)
            self._dropped.append(active.request_id)
            if active.hold_kv_s > 0:
                self._holds[active.request_id] = active.hold_kv_s
            self._unreserve(active)
        elif active in self._waiting:
            self._waiting.remove(active)
            if active.preemptions:
                self._discard(active)
        active.done.set()
        if not self._requests:
            self._idle.set()

    def _fail(self, exc: BaseException) -> None:
        self._dead = exc
        for active in list(self._requests.values()):
            active.out.queue.put_nowait(EngineDead(f"engine failed: {exc!r}"))
            self._retire(active)

    # ------------------------------------------------------------ pause/sleep
    async def pause(self, mode: PauseMode = "wait") -> None:
        if mode not in ("wait", "abort"):
            raise InvalidRequest(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._check_alive()
        self._paused = True
        if mode == "abort":
            await self.abort(None)
        else:
            await self._idle.wait()

    async def resume(self) -> None:
        self._check_alive()
        self._paused = False
        self._work.set()

    async def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level!r}")
        self._check_alive()
        self._kv_resident = False  # refuses new requests from here on
        await self.abort(None)
        async with self._step_lock:
            await self._reset_batch()
            freed = await self._release_weights(level)
            self._weights_resident = False
            if level == 2:
                self._weights_loaded = False
        return freed

    async def wake_up(self, tags: set[str] | None = None) -> None:
        tags = set(tags) if tags else set(WAKE_TAGS)
        unknown = tags - WAKE_TAGS
        if unknown:
            raise InvalidRequest(f"unknown wake_up tags {sorted(unknown)}; expected a subset of {sorted(WAKE_TAGS)}")
        self._check_alive()
        async with self._step_lock:
            if "weights" in tags and not self._weights_resident:
                restored = await self._restore_weights()
                self._weights_resident = True
                self._weights_loaded = self._weights_loaded and restored
            if "kv_cache" in tags:
                self._kv_resident = True
        self._work.set()

    async def flush_cache(self) -> None:
        self._check_alive()
        async with self._step_lock:
            await self._flush_cache()

    # ---------------------------------------------------------------- weights
    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidRequest(f"weight version must be an integer, got {version!r}")
        self._check_alive()
        async with self._step_lock:
            if not self._weights_resident:
                raise EngineUnavailable("weights are asleep; call wake_up({'weights'}) before load_weights")
            self._check_weights(named_tensors, require_complete=not self._weights_loaded)
            await self._swap_weights(named_tensors)
            self._weight_version = version
            self._weights_loaded = True
        self._work.set()

    # ---------------------------------------------------------------- metrics
    def load_snapshot(self) -> LoadSnapshot:
        used = sum(a.held_tokens for a in self._running)
        itl_mean, itl_p95 = self._metrics.itl_stats()
        capacity = max(1, self.max_total_tokens)
        return LoadSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=min(1.0, used / capacity),
            max_total_tokens=self.max_total_tokens,
            used_tokens=used,
            tokens_per_second=self._metrics.tokens_per_second(),
            queue_time_p95_s=self._metrics.queue_time_p95(),
            ttft_p95_s=self._metrics.ttft_p95(),
            itl_mean_s=itl_mean,
            itl_p95_s=itl_p95,
        )


def _private_copy(request: EngineRequest) -> EngineRequest:
    """A copy the caller cannot change under a running request."""
    sampling = dataclasses.replace(request.sampling, stop_token_ids=list(request.sampling.stop_token_ids))
    segments = [dataclasses.replace(s, token_ids=list(s.token_ids), logprobs=list(s.logprobs))
                for s in request.resume_segments]
    return dataclasses.replace(request, prompt_token_ids=list(request.prompt_token_ids),
                               sampling=sampling, resume_segments=segments)
