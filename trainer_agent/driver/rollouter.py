"""The rollouter of the fully-async driver.

It takes prompts from a data source, submits each prompt ``n`` times (one
GRPO group) through an injected async ``generate(request) -> result``
callable (in production a LoadBalancerService client, see
``lb_client.LoadBalancerGenerate``), and puts each group into the
:class:`MessageQueue` as a unit once all its ``n`` samples are generated.

Units: samples (prompt groups) outside, completions inside; see :mod:`.rollout_types`.

Concurrency: at most ``capacity = min(active_replicas * concurrent_samples_per_replica,
max_required_completions)`` requests are in flight (rollmesh routes each
response separately, so its concurrency unit is the request; verl counts
prompts). ``active_replicas`` is an
injected callable read at every scheduling pass (and every
``capacity_poll_interval`` seconds, and on ``notify_capacity_changed()``);
each change is recorded in the rollout history. A capacity drop never
cancels in-flight requests; it only holds back new ones.

Staleness: a new group is admitted only while ``staleness_samples + n <=
max_required_completions`` (``staleness_samples`` counts completions). ``reset_staleness(v)`` sets ``staleness_samples`` to
the samples that already exist for the new window (queued samples plus all
``n`` samples of every admitted, not yet queued group), so unconsumed and
in-flight samples count against the new window's budget. With an empty
queue and nothing in flight, exactly ``max_required_samples`` groups are
generated per window before the rollouter pauses.

Queue bound: no request is submitted while ``queue.size() >= max_queue_size``.
Requests already in flight still complete; if their group then overflows
the queue, the queue drops its oldest group and counts exactly that.

History: ``(t, active_tasks, capacity)`` points, with the injected clock,
on every submit, completion, drain (completion while paused), cancellation,
failure and capacity change; ``reset_staleness`` closes the window and
returns ``dynamic_resource/rollout_resource_utilization`` computed from it
(section 4.2 of dynamic-resource-scheduling.md) together with
``fully_async/rollouter/step_generated_samples``.

Multi-turn: with a ``trajectory`` (:mod:`.trajectory`), each sample is a
trajectory of several requests (each turn retried as a request is) instead
of one request.

Failures: a request is retried ``max_retries`` times (waits from ``retry_backoff_s``, doubling), unless
the balancer already retried it and says so (``non_retryable``: no call is retried by two layers); when it
still fails,
every in-flight request is cancelled, the queue is failed
(``MessageQueue.fail``) and ``run()`` raises :class:`RolloutFailed`. A
failure never looks like a normal end of data (known weakness 16).

Checkpoint: ``state_dict()`` holds every admitted but not yet queued group,
with the samples of it that already completed; after ``load_state_dict``
the missing samples are generated again before new prompts are taken
(known weakness 17).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from mesh_runtime.retry import RetryPolicy, permanent
from trainer_agent.driver.queue import MessageQueue, RolloutFailed, Sample
from trainer_agent.driver.rollout_state import STATE_VERSION, Group, decode_pending, encode_pending
from trainer_agent.driver.rollout_types import (  # noqa: F401 - the rollouter's vocabulary, re-exported
    GenerateFn,
    GenerationError,
    RolloutRequest,
    GenerationResult,
    HistoryPoint,
    Prompt,
    RolloutConfig,
    RolloutTotals,
    Segment,
    rollout_resource_utilization,
)

Trajectory = Callable[[str, int, RolloutRequest, Callable[[RolloutRequest], Awaitable[GenerationResult]]],
                      Awaitable[Sample]]
"""A multi-turn sample: ``(group_id, index, first request, call) -> Sample``, each turn through ``call`` (the
rollouter's retrying generate); see :mod:`.trajectory`."""

UTILIZATION_METRIC = "dynamic_resource/rollout_resource_utilization"
STEP_GENERATED_METRIC = "fully_async/rollouter/step_generated_samples"


class Rollouter:
    def __init__(
        self,
        config: RolloutConfig,
        queue: MessageQueue,
        generate: GenerateFn,
        prompts: Iterable[Prompt],
        active_replicas: Callable[[], int],
        *,
        clock: Callable[[], float] = time.monotonic,
        param_version: int = 0,
        is_retryable: Callable[[BaseException], bool] | None = None,
        capacity_poll_interval: float | None = 1.0,
        trajectory: Trajectory | None = None,
    ) -> None:
        if config.max_required_samples < 1:
            raise ValueError(
                f"max_required_samples {config.max_required_samples} is below one sample (prompt group)"
            )
        if queue.max_queue_size < config.n:
            raise ValueError(f"max_queue_size {queue.max_queue_size} is below the group size {config.n}")
        self.config = config
        self._queue = queue
        self._generate = generate
        self._prompts: Iterator[Prompt] = iter(prompts)
        self._active_replicas = active_replicas
        self._clock = clock
        self._is_retryable = is_retryable or (lambda exc: not permanent(exc))
        backoff = config.retry_backoff_s
        self._retry_policy = RetryPolicy(initial_s=backoff, max_s=backoff * 2 ** config.max_retries,
                                         max_attempts=config.max_retries + 1)
        self._poll = capacity_poll_interval
        self._trajectory = trajectory

        self._param_version = int(param_version)
        self._pending: dict[str, Group] = {}
        self._active: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._capacity = 0
        self._paused: str | None = None
        self._data_exhausted = False
        self._lookahead: Prompt | None = None
        self._failure: BaseException | None = None
        self._running = False
        self._wake = asyncio.Event()
        self._epoch = 0

        self._staleness_samples = 0
        self._step_generated = 0
        self._groups_admitted = 0
        self._prompts_taken = 0
        self._totals = RolloutTotals()

        self._history: list[HistoryPoint] = []
        self._last_window: list[HistoryPoint] = []
        queue.add_consume_listener(self._wake.set)

    # -- public state --------------------------------------------------

    @property
    def param_version(self) -> int:
        return self._param_version

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def active_tasks(self) -> int:
        return len(self._active)

    @property
    def paused(self) -> str | None:
        """Why new requests are held back now: "staleness", "queue_full" or None."""
        return self._paused

    @property
    def staleness_samples(self) -> int:
        return self._staleness_samples

    @property
    def step_generated_samples(self) -> int:
        return self._step_generated

    @property
    def history(self) -> list[HistoryPoint]:
        """Points of the current window (since the last reset_staleness)."""
        return list(self._history)

    @property
    def last_window_history(self) -> list[HistoryPoint]:
        """Points of the window closed by the last reset_staleness."""
        return list(self._last_window)

    def stats(self) -> dict[str, int]:
        return {
            "param_version": self._param_version,
            "prompts_taken": self._prompts_taken,
            "groups_admitted": self._groups_admitted,
            "pending_groups": len(self._pending),
            **self._totals.as_dict(),
            "active_tasks": len(self._active),
            "capacity": self._capacity,
            "staleness_samples": self._staleness_samples,
            "step_generated_samples": self._step_generated,
        }

    # -- control -------------------------------------------------------

    def notify_capacity_changed(self) -> None:
        """Re-read the active replica count now (records the change)."""
        self._refresh_capacity()
        self._wake.set()

    def reset_staleness(self, param_version: int) -> dict[str, float]:
        """A parameter sync happened: close the history window, return its
        metrics, and open a new staleness budget for ``param_version``."""
        self._record("reset")
        metrics = {
            UTILIZATION_METRIC: rollout_resource_utilization(self._history),
            STEP_GENERATED_METRIC: float(self._step_generated),
        }
        self._last_window = self._history
        self._param_version = int(param_version)
        self._step_generated = 0
        self._staleness_samples = self._queue.size() + self.config.n * len(self._pending)
        self._history = []
        self._record("window_start")
        self._wake.set()
        return metrics

    async def run(self) -> dict[str, int]:
        """Generate until the data source is exhausted and every admitted
        group is queued; then close the queue and return ``stats()``.

        Raises :class:`RolloutFailed` (after failing the queue) when a
        generation fails beyond its retries or the data source raises.
        Cancelling ``run()`` cancels the in-flight requests and keeps their
        groups pending (see ``state_dict``); the queue is left open.
        """
        if self._running:
            raise RuntimeError("Rollouter.run() is already running")
        self._running = True
        self._failure = None
        self._refresh_capacity()
        self._record("start")
        try:
            while True:
                self._wake.clear()
                if self._failure is not None:
                    raise self._failure
                self._refresh_capacity()
                self._fill()
                if self._data_exhausted and not self._pending:
                    break
                await self._wait()
        except asyncio.CancelledError:
            await self._cancel_active()
            raise
        except Exception as exc:
            await self._cancel_active()
            self._queue.fail(exc)
            raise RolloutFailed(f"rollouter failed: {exc!r}") from exc
        finally:
            self._running = False
            self._paused = None
        self._queue.close()
        return self.stats()

    # -- scheduling ----------------------------------------------------

    async def _wait(self) -> None:
        if self._poll is None:
            await self._wake.wait()
            return
        # asyncio.wait, unlike wait_for on 3.11, never swallows a cancel of this task.
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=self._poll)
        finally:
            waiter.cancel()

    def _refresh_capacity(self) -> None:
        replicas = max(0, int(self._active_replicas()))
        cap = min(replicas * self.config.concurrent_samples_per_replica, self.config.max_required_completions)
        if cap != self._capacity:
            self._capacity = cap
            self._record("capacity")

    def _fill(self) -> None:
        self._paused = None
        while True:
            if self._queue.size() >= self._queue.max_queue_size:
                self._paused = "queue_full"
                return
            if self._budget_exhausted():
                self._paused = "staleness"
                return
            if len(self._active) >= self._capacity:
                return
            job = self._next_job()
            if job is None:
                return
            self._submit(*job)

    def _unsubmitted(self) -> tuple[Group, int] | None:
        for group in self._pending.values():
            if len(group.done) + len(group.in_flight) == self.config.n:
                continue
            for index in range(self.config.n):
                if index not in group.done and index not in group.in_flight:
                    return group, index
        return None

    def _budget_exhausted(self) -> bool:
        """No admitted sample is waiting to be submitted and the staleness
        budget has no room for another group."""
        return (
            self._staleness_samples + self.config.n > self.config.max_required_completions
            and self._unsubmitted() is None
            and self._peek_prompt() is not None
        )

    def _peek_prompt(self) -> Prompt | None:
        """The next prompt without admitting it, so that the end of data is
        noticed even while the staleness budget is spent. A looked-ahead
        prompt is not counted in ``prompts_taken``."""
        if self._lookahead is None and not self._data_exhausted:
            try:
                self._lookahead = next(self._prompts)
            except StopIteration:
                self._data_exhausted = True
        return self._lookahead

    def _next_job(self) -> tuple[Group, int] | None:
        job = self._unsubmitted()
        if job is not None:
            return job
        prompt = self._peek_prompt()
        if prompt is None:
            return None
        if self._staleness_samples + self.config.n > self.config.max_required_completions:
            self._paused = "staleness"
            return None
        self._lookahead = None
        self._prompts_taken += 1
        group_id = f"{prompt.prompt_id}#{self._groups_admitted}"
        self._groups_admitted += 1
        self._staleness_samples += self.config.n
        group = Group(group_id=group_id, prompt=prompt)
        self._pending[group_id] = group
        return group, 0

    def _submit(self, group: Group, index: int) -> None:
        cfg = self.config
        suffix = f"@{self._epoch}" if self._epoch else ""
        request = RolloutRequest(
            request_id=f"{group.group_id}/{index}{suffix}",
            prompt_token_ids=list(group.prompt.token_ids),
            session_id=group.group_id,
            partial_rollout=cfg.partial_rollout,
            param_version=self._param_version,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            logprobs=cfg.logprobs,
            retry_budget=cfg.lb_retry_budget,
            stop_token_ids=list(cfg.stop_token_ids),
        )
        group.in_flight.add(index)
        key = (group.group_id, index)
        self._active[key] = asyncio.create_task(self._run_one(group, index, request), name=f"rollout:{key}")
        self._totals.submitted_samples += 1
        self._record("submit")

    async def _run_one(self, group: Group, index: int, request: RolloutRequest) -> None:
        key = (group.group_id, index)
        try:
            if self._trajectory is not None:
                sample = await self._trajectory(group.group_id, index, request, self._call_with_retries)
            else:
                result = await self._call_with_retries(request)
                sample = self._to_sample(group, index, request, result)
        except asyncio.CancelledError:
            self._finish_task(key, group, index, "cancel")
            raise
        except Exception as exc:
            self._finish_task(key, group, index, "failed")
            if self._failure is None:
                self._failure = exc
            self._wake.set()
            return
        group.done[index] = sample
        self._totals.completed_samples += 1
        self._finish_task(key, group, index, "drain" if self._paused else "complete")
        if len(group.done) == self.config.n:
            del self._pending[group.group_id]
            finished = [group.done[i] for i in range(self.config.n)]
            self._totals.dropped_by_queue += self._queue.put_group(finished)
            self._totals.groups_enqueued += 1
            self._step_generated += 1  # verl's step_generated_samples: fully generated samples (groups)
        self._wake.set()

    def _finish_task(self, key: tuple[str, int], group: Group, index: int, kind: str) -> None:
        self._active.pop(key, None)
        group.in_flight.discard(index)
        self._record(kind)

    async def _call_with_retries(self, request: RolloutRequest) -> GenerationResult:
        """One request through the rollouter's retry policy: a failure the balancer did not already retry (it
        could not be reached, its stream broke, the request came back aborted) is tried again; one the
        balancer spent its own retry budget on says so (``non_retryable``) and is raised at once."""
        async def call() -> GenerationResult:
            result = await self._generate(request)
            if result.finish_reason == "aborted":
                raise GenerationError(f"generation {request.request_id} was aborted")
            return result

        def retried(err: BaseException, wait: float) -> None:
            self._totals.retries += 1

        return await self._retry_policy.run(call, retry_if=self._is_retryable, on_retry=retried)

    @staticmethod
    def _to_sample(group: Group, index: int, request: RolloutRequest, result: GenerationResult) -> Sample:
        completion: list[int] = []
        logprobs: list[float] = []
        for seg in result.segments:
            completion.extend(seg.token_ids)
            logprobs.extend(seg.logprobs)
        return Sample(
            group_id=group.group_id,
            index=index,
            prompt_ids=list(group.prompt.token_ids),
            completion_ids=completion,
            logprobs=logprobs,
            param_version=request.param_version,
            weight_versions=[seg.weight_version for seg in result.segments],
            segment_lengths=[len(seg.token_ids) for seg in result.segments],
            finish_reason=result.finish_reason,
        )

    async def _cancel_active(self) -> None:
        tasks = list(self._active.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # Tasks cancelled before they ever ran did not clean up after themselves.
        for key in list(self._active):
            group = self._pending.get(key[0])
            self._active.pop(key, None)
            if group is not None:
                group.in_flight.discard(key[1])
            self._record("cancel")

    def _record(self, kind: str) -> None:
        self._history.append(HistoryPoint(self._clock(), len(self._active), self._capacity, kind))

    # -- checkpoint ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly snapshot. ``prompts_taken`` says how many prompts
        the data source has handed out: resume the data source after them.
        In-flight requests are saved as not yet generated."""
        return {
            "version": STATE_VERSION,
            "param_version": self._param_version,
            "epoch": self._epoch,
            "staleness_samples": self._staleness_samples,
            "step_generated_samples": self._step_generated,
            "groups_admitted": self._groups_admitted,
            "prompts_taken": self._prompts_taken,
            "totals": self._totals.as_dict(),
            "pending": encode_pending(self._pending.values()),
        }

    def load_state_dict(self, state: dict[str, Any], *, skip_taken_prompts: bool = False) -> None:
        """Restore a snapshot into a rollouter that is not running.

        With ``skip_taken_prompts`` the data source is advanced past the
        ``prompts_taken`` prompts the snapshot already admitted (for a source
        that starts from the beginning again, as after a process restart).
        """
        if self._running:
            raise RuntimeError("cannot load state into a running Rollouter")
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ValueError(f"unsupported rollouter state version {state.get('version')!r}")
        self._param_version = int(state["param_version"])
        self._epoch = int(state["epoch"]) + 1
        self._staleness_samples = int(state["staleness_samples"])
        self._step_generated = int(state["step_generated_samples"])
        self._groups_admitted = int(state["groups_admitted"])
        self._prompts_taken = int(state["prompts_taken"])
        self._totals = RolloutTotals.from_dict(state["totals"])
        self._pending = {group.group_id: group for group in decode_pending(state["pending"])}
        if skip_taken_prompts:
            self._lookahead = None
            for _ in range(self._prompts_taken):
                if next(self._prompts, None) is None:
                    self._data_exhausted = True
                    break
