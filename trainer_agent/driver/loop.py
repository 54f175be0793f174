"""The fully-async training loop: rollouter + queue + GRPO trainer + the controller's step protocol.

:class:`FullyAsyncLoop` runs the :class:`~trainer_agent.driver.rollouter.Rollouter`
as a background task (it keeps generating through the load balancer while the
trainer trains) and drives ``steps`` training steps. Per global step ``g``:

1. ``BeginTrainingStep(g, report)``; when it answers ``deactivate``, wait until
   the queue holds ``wait_samples`` (at most ``wait_timeout``), then
   ``ReleaseHybridReplicas(g, buffered_samples, waited, wait_expired)``;
2. ``trigger_parameter_sync_step`` times: take ``required_samples`` from the
   queue (``get_batch``; its wait time and waited-on samples go into
   ``step_wait_times`` / ``step_wait_samples``) and do one GRPO step (rewards
   from ``reward_fn`` when the samples carry none, timed as ``reward``);
   every GRPO step publishes the next weight version to the trainer's
   weight source;
3. ``reset_staleness(v)`` on the rollouter with the new version ``v``: it closes
   the rollout window, whose utilisation metrics and concurrency history go
   into the report;
4. ``CompleteTrainingStep(g, v, report)``: the controller broadcasts version
   ``v`` from the trainer agent (whose weight source must be the trainer's) and
   may activate the hybrid replicas. Standalone replicas whose part of the
   broadcast failed are synced again one by one (``SyncWeights``) until they
   hold ``v`` or the controller no longer lists them as live: one dead
   receiver must not leave the healthy ones stale and out of routing.

Counts in the step protocol are in samples of one prompt each (with its
``n`` responses), as in verl (:mod:`mesh_runtime.samples`): ``required_samples
= ppo_mini_batch_size x require_batches``, ``expected_samples`` is cumulative
(``required x trigger x g``), ``buffer_samples = required x trigger x
staleness_threshold`` (constant), ``total_generated_samples``, ``queue_size``
and ``step_wait_samples`` are the queue's group counts; the controller's
``wait_samples`` is a group count too. The queue itself counts completions
(exactly ``n`` per group); :class:`StepRecord`'s queue counters
(``queue_size``, ``generated``, ``consumed``, ``dropped``) are completions.
``timing_raw["param_sync"]`` carries the previous step's Complete call (the
sync of this step is not over when its report is sent).

Hybrid colocation: with ``offload_during_hybrid`` the trainer's parameters and
optimizer state are offloaded after a ``CompleteTrainingStep`` that activated
the hybrid replicas (they now use the trainer's accelerators) and onloaded
before the next GRPO update (the controller has put them back to sleep by
then). ``on_phase(name)`` reports ``waiting`` (step protocol and sample
collection), ``training`` and ``syncing``.

Checkpoint: ``state_dict()`` between steps holds the queued samples, the
rollouter's admitted groups (with their finished samples; in-flight ones are
regenerated after a restore), the counters and the next global step, so a
restart loses no sample (known weakness 17). The model and optimizer are the
trainer's to save (:mod:`trainer_agent.driver.checkpoint`).

Resume across processes: after :meth:`load_state_dict` the trainer holds
the checkpointed weight version ``v`` while fresh replica processes hold the
model's initial weights (version 0). :meth:`bring_replicas_to` syncs every
replica behind ``v`` through the controller's ``SyncWeights`` (standalone
replicas and sleeping hybrid ones) before :meth:`run` starts the rollouter, so
nothing of the resumed run is generated with old weights. The controller of
the new mesh starts with no step history, so ``BeginTrainingStep(k + 1)`` and
``CompleteTrainingStep(k + 1, v + 1)`` are accepted as its first step.

Failures never look like a normal end: a rollouter failure (``RolloutFailed``
from the queue), an RPC error or a training error propagates from
:meth:`FullyAsyncLoop.run`, after the rollouter is cancelled. Only when the
prompt source is exhausted does the loop end early, normally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


from rollmesh.common.v1 import types_pb2

from trainer_agent.driver.mesh_calls import GONE_STATES, ReplicaCount, resync_replicas
from trainer_agent.driver.queue import MessageQueue, Sample
from trainer_agent.driver.rollouter import Trajectory
from trainer_agent.driver.rollouter import GenerateFn, Prompt, RolloutConfig, Rollouter
from trainer_agent.training.grpo import GrpoTrainer
from trainer_agent.training.grpo import Sample as GrpoSample
from trainer_client.steps import Counters, StepProtocol

from .sample_metrics import single_version, step_sample_metrics

log = logging.getLogger(__name__)

RewardFn = Callable[[Sequence[int], Sequence[int]], float]
Scorer = Callable[[Sequence[tuple[str, Sequence[int]]]], tuple[list[float], dict[str, float]]]
"""Scores ``(prompt_id, completion_ids)`` pairs: ``(scores, extra metrics)``; replaces ``reward_fn`` for prompts
that carry more than their tokens (a dataset row's ground truth). Runs in a worker thread."""
# ReplicaState values in which the controller's SyncWeights accepts a replica.
_SYNCABLE_STATES = frozenset({types_pb2.REPLICA_STATE_ACTIVE, types_pb2.REPLICA_STATE_PAUSED,
                              types_pb2.REPLICA_STATE_SLEEPING})
# The loop's phases as activities of the resource-time picture's trainer row.
_PHASE_ACTIVITY = {"waiting": "wait", "training": "train", "syncing": "weight_sync"}
STEP_TIMING_KEYS = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


@dataclass
class StepRecord:
    """What one global step did (one entry of :meth:`FullyAsyncLoop.run`'s result)."""

    global_step: int
    weight_version: int
    reward_mean: float
    metrics: dict[str, float]
    timing_raw: dict[str, float]
    deactivated: bool
    released_replica_ids: list[str]
    waited_s: float
    wait_expired: bool
    step_wait_times: list[float]
    step_wait_samples: list[int]
    queue_size: int
    generated: int
    consumed: int
    dropped: int
    step_consumed: int
    step_dropped: int
    rollout_metrics: dict[str, float]
    hybrid_activated: bool
    hybrid_sync_skipped: bool
    synced_replica_ids: list[str] = field(default_factory=list)
    bytes_saved: int = 0
    offload_s: float = 0.0
    onload_s: float = 0.0
    resynced_replica_ids: list[str] = field(default_factory=list)
    weight_sync: dict[str, Any] = field(default_factory=dict)
    """What the step's weight syncs sent (:func:`weight_sync_summary`): bytes, the delta's base version, bytes
    and density, and each replica's copy (delta, full or peer) and who sent it."""
    samples: dict[str, Any] = field(default_factory=dict)
    """The trained samples' staleness, weight versions and turn counts (:mod:`.sample_metrics`)."""
    activities: list[dict[str, Any]] = field(default_factory=list)
    """What the trainer did during the step, on the wall clock: ``{"activity": "wait" | "train" |
    "weight_sync", "start": epoch seconds, "end": epoch seconds}`` (the resource-time picture's trainer row)."""


def task_prompts(task: Any, count: int, seed: int, *, repeat: bool = True, **task_kwargs: Any) -> Iterator[Prompt]:
    """Prompts of a task module (``task.make_prompts(count, seed)``), cycled forever when ``repeat``."""
    pairs = task.make_prompts(count, seed, **task_kwargs)
    prompts = [Prompt(f"p{i}", list(prompt)) for i, (prompt, _answer) in enumerate(pairs)]
    return itertools.cycle(prompts) if repeat else iter(prompts)


class FullyAsyncLoop:
    """Drives ``steps`` fully-async training steps; see the module docstring."""

    def __init__(self, controller: Any, generate: GenerateFn, trainer: GrpoTrainer, config: RolloutConfig,
                 prompts: Iterable[Prompt], reward_fn: RewardFn, *, replica_count: ReplicaCount,
                 max_queue_size: int | None = None, first_step: int = 1, rpc_timeout_s: float = 60.0,
                 sync_timeout_s: float = 300.0, collect_timeout_s: float | None = None,
                 replica_poll_s: float = 0.5, on_step: Callable[[StepRecord], Awaitable[None]] | None = None,
                 on_phase: Callable[[str], None] | None = None, offload_during_hybrid: bool = False,
                 scorer: Scorer | None = None, trajectory: Trajectory | None = None) -> None:
        self.controller = controller
        self.steps = StepProtocol(controller, window_s=rpc_timeout_s, sync_window_s=sync_timeout_s)
        """The step protocol's calls, as a custom trainer's MeshClient makes them (one report builder)."""
        self.trainer = trainer
        self.config = config
        self.reward_fn = reward_fn
        self.scorer = scorer
        # the bound is in samples (prompt groups); the queue counts completions
        self.queue = MessageQueue((max_queue_size or 2 * config.max_required_samples) * config.n)
        self._replica_count = replica_count
        self._replicas = 0
        self.rollouter = Rollouter(config, self.queue, generate, prompts, lambda: self._replicas,
                                   clock=time.time, param_version=trainer.weight_version,
                                   capacity_poll_interval=replica_poll_s, trajectory=trajectory)
        self._next_step = first_step
        self._rpc_timeout = rpc_timeout_s
        self._sync_timeout = sync_timeout_s
        self._collect_timeout = collect_timeout_s
        self._poll_s = replica_poll_s
        self._on_step = on_step
        self._notify_phase = on_phase or (lambda phase: None)
        self._activity: tuple[str, float] | None = None
        self._activities: list[dict[str, Any]] = []
        self._offload = offload_during_hybrid
        self._last_sync_s = 0.0
        self.records: list[StepRecord] = []
        self.last_step: int | None = None   # set by a stop request: no step after it starts

    # -- running -----------------------------------------------------------------------------------

    async def run(self, steps: int) -> list[StepRecord]:
        """Run ``steps`` global steps (fewer if the prompts run out or a stop request set ``last_step``);
        raise on any failure."""
        await self._refresh_replicas()
        rollout = asyncio.create_task(self.rollouter.run(), name="rollouter")
        poller = asyncio.create_task(self._poll_replicas(), name="replica-poller")
        try:
            for _ in range(steps):
                if self.last_step is not None and self._next_step > self.last_step:
                    break
                record = await self._step(self._next_step, rollout)
                if record is None:
                    break
                self._next_step += 1
                self.records.append(record)
                if self._on_step is not None:
                    await self._on_step(record)
            if rollout.done() and not rollout.cancelled():
                rollout.result()  # a failure the steps did not see is still a failure
        finally:
            poller.cancel()
            rollout.cancel()
            await asyncio.gather(poller, rollout, return_exceptions=True)
        return list(self.records)

    async def _poll_replicas(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self._refresh_replicas()

    async def _refresh_replicas(self) -> None:
        count = int(await self._replica_count())
        if count != self._replicas:
            self._replicas = count
            self.rollouter.notify_capacity_changed()

    async def _checked(self, aw: Awaitable[Any], rollout: asyncio.Task) -> Any:
        """Await ``aw``; a rollouter that fails meanwhile fails the loop at once."""
        work = asyncio.ensure_future(aw)
        done, _ = await asyncio.wait({work, rollout}, return_when=asyncio.FIRST_COMPLETED)
        failed = rollout.exception() if work not in done else None
        if failed is not None:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise failed
        return await work

    # -- one step ----------------------------------------------------------------------------------

    def _on_phase(self, phase: str | None) -> None:
        """Enter ``phase`` (None: leave the current one), closing the previous activity interval."""
        now = time.time()
        if self._activity is not None and self._activity[0] != phase:
            name, since = self._activity
            self._activities.append({"activity": _PHASE_ACTIVITY[name], "start": since, "end": now})
        if phase is None:
            self._activity = None
            return
        if self._activity is None or self._activity[0] != phase:
            self._activity = (phase, now)
        self._notify_phase(phase)

    def _take_activities(self) -> list[dict[str, Any]]:
        self._on_phase(None)
        taken, self._activities = self._activities, []
        return taken

    async def _step(self, gs: int, rollout: asyncio.Task) -> StepRecord | None:
        cfg, q = self.config, self.queue
        self._on_phase("waiting")
        begin = await self._checked(self.steps.begin_step(gs, self._counters()), rollout)
        released: list[str] = []
        waited, expired = 0.0, False
        if begin.deactivate:
            waited, expired = await self._checked(self._wait_for(begin.wait_samples, begin.wait_timeout_s), rollout)
            release = await self._checked(self.steps.release_hybrids(
                gs, buffered_samples=self._queued(), waited_s=waited, wait_expired=expired), rollout)
            released = release.released_replica_ids
            await self._refresh_replicas()

        consumed0, dropped0 = q.consumed, q.dropped
        allocated0 = time.perf_counter()
        wait_times: list[float] = []
        wait_samples: list[int] = []
        timing = {k: 0.0 for k in STEP_TIMING_KEYS}
        metrics: dict[str, float] = {}
        rewards: list[float] = []
        trained: list[Sample] = []
        onload_s = 0.0
        for _ in range(cfg.trigger_parameter_sync_step):
            batch = await q.get_batch(cfg.required_completions, self._collect_timeout)
            wait_times.append(batch.waited_s)
            wait_samples.append(batch.wait_samples // cfg.n)  # whole groups: exact
            if batch.end_of_data and len(batch.samples) < cfg.required_completions:
                return None  # the prompts ran out: a normal end
            if batch.timed_out:
                raise TimeoutError(f"step {gs}: {len(batch.samples)} of {cfg.required_completions} responses "
                                   f"({cfg.required_samples} samples of {cfg.n}) after {batch.waited_s:.1f} s")
            groups = self._groups(batch.samples)
            trained.extend(batch.samples)
            if self.trainer.offloaded:
                started = time.perf_counter()
                await asyncio.to_thread(self.trainer.onload)
                onload_s += time.perf_counter() - started
            self._on_phase("training")
            started = time.perf_counter()
            extra: dict[str, float] = {}
            if self.scorer is not None:
                groups, extra = await self._checked(asyncio.to_thread(self._score, batch.samples), rollout)
                scored_s = time.perf_counter() - started
            result = await self._checked(asyncio.to_thread(self.trainer.step, groups, reward_fn=None
                                                           if self.scorer is not None else self._reward), rollout)
            timing["step"] = timing.get("step", 0.0) + time.perf_counter() - started
            for key, value in result.timing_raw.items():
                timing[key] = timing.get(key, 0.0) + value
            if self.scorer is not None:
                timing["reward"] = timing.get("reward", 0.0) + scored_s
            metrics = {**result.metrics, **extra}
            rewards.append(result.metrics["critic/rewards/mean"])
            self._on_phase("waiting")
        allocated = time.perf_counter() - allocated0
        # The reference's timing_s/wait_for_enough_samples: the wait before the hybrids were released.
        timing["wait_for_enough_samples"] = waited

        version = self.trainer.weight_version
        rollout_metrics = self.rollouter.reset_staleness(version)
        window = self.rollouter.last_window_history
        counters = self._counters(
            timing={**timing, "param_sync": self._last_sync_s}, wait_times=wait_times, wait_samples=wait_samples,
            train_allocated_s=allocated, train_compute_s=sum(timing[k] for k in STEP_TIMING_KEYS),
            step_generated_samples=int(rollout_metrics.get("fully_async/rollouter/step_generated_samples", 0)),
            consumed_samples=(q.consumed - consumed0) // cfg.n, dropped_samples=(q.dropped - dropped0) // cfg.n,
            rollout_concurrency=[(point.t, point.active_tasks, point.capacity) for point in window])

        self._on_phase("syncing")
        sync0 = time.perf_counter()
        completed = await self._checked(self.steps.complete_step(gs, version, counters), rollout)
        done = completed.response
        self._last_sync_s = time.perf_counter() - sync0
        await self._refresh_replicas()
        timing["param_sync"] = self._last_sync_s
        offload_s = 0.0
        if done.hybrid_activated and self._offload:
            started = time.perf_counter()
            await asyncio.to_thread(self.trainer.offload)
            offload_s = time.perf_counter() - started
        synced = [r.replica_id for r in [*done.standalone_sync.replica_results, *done.hybrid_sync.replica_results]
                  if r.ok]
        failed = [r.replica_id for r in done.standalone_sync.replica_results if not r.ok]
        resynced = await self._checked(self._resync(gs, version, failed), rollout) if failed else []
        synced += resynced
        return StepRecord(
            global_step=gs, weight_version=version, reward_mean=sum(rewards) / len(rewards), metrics=metrics,
            timing_raw=timing, deactivated=begin.deactivate, released_replica_ids=released, waited_s=waited,
            wait_expired=expired, step_wait_times=wait_times, step_wait_samples=wait_samples, queue_size=q.size(),
            generated=q.generated, consumed=q.consumed, dropped=q.dropped,
            step_consumed=q.consumed - consumed0, step_dropped=q.dropped - dropped0, rollout_metrics=rollout_metrics,
            hybrid_activated=done.hybrid_activated, hybrid_sync_skipped=done.hybrid_sync_skipped,
            synced_replica_ids=synced, bytes_saved=int(done.bytes_saved), offload_s=offload_s, onload_s=onload_s,
            resynced_replica_ids=resynced, activities=self._take_activities(),
            weight_sync=weight_sync_summary(done.standalone_sync, done.hybrid_sync),
            samples=step_sample_metrics(trained, version))

    # -- checkpoint ----------------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        return self._next_step

    def state_dict(self) -> dict[str, Any]:
        """Driver state between steps (JSON-friendly); see the module docstring."""
        return {"version": 1, "next_step": self._next_step, "last_sync_s": self._last_sync_s,
                "queue": self.queue.state_dict(), "rollouter": self.rollouter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before :meth:`run`; the prompt source resumes after the prompts already taken."""
        if int(state.get("version", 0)) != 1:
            raise ValueError(f"unsupported driver state version {state.get('version')!r}")
        self.queue.load_state_dict(state["queue"])
        self.rollouter.load_state_dict(state["rollouter"], skip_taken_prompts=True)
        self._next_step = int(state["next_step"])
        self._last_sync_s = float(state.get("last_sync_s", 0.0))

    async def bring_replicas_to(self, version: int) -> dict[str, int]:
        """Before the first step of a resumed run: every live replica to the trainer's ``version``.

        One ``SyncWeights`` for the replicas behind ``version`` (standalone and
        sleeping hybrid ones), then the standalone replicas whose part failed
        one by one (:meth:`_resync`). Raises ``RuntimeError`` when a live
        standalone replica still does not hold ``version`` (it would generate
        with weights the trainer no longer has). Returns every listed
        replica's weight version afterwards.
        """
        from rollmesh.controller.v1 import registry_pb2, weight_sync_pb2

        listed = await self.controller.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=self._rpc_timeout)
        behind = [r for r in listed.replicas if r.state in _SYNCABLE_STATES and r.weight_version < version]
        if behind:
            reply = await self.controller.SyncWeights(weight_sync_pb2.SyncWeightsRequest(
                weight_version=version, replica_ids=[r.replica_id for r in behind],
                request_id=f"resume-{self._next_step}-{version}"), timeout=self._sync_timeout)
            failed = {r.replica_id for r in reply.result.replica_results if not r.ok}
            standalone = [r.replica_id for r in behind if r.replica_id in failed
                          and r.kind == types_pb2.REPLICA_KIND_STANDALONE]
            if standalone:
                await self._resync(self._next_step - 1, version, standalone)
            listed = await self.controller.ListReplicas(registry_pb2.ListReplicasRequest(),
                                                        timeout=self._rpc_timeout)
        stale = sorted(f"{r.replica_id} (version {r.weight_version})" for r in listed.replicas
                       if r.kind == types_pb2.REPLICA_KIND_STANDALONE and r.state not in GONE_STATES
                       and r.weight_version < version)
        if stale:
            raise RuntimeError(f"standalone replicas {', '.join(stale)} could not be brought to the checkpoint's "
                               f"weight version {version}")
        return {r.replica_id: r.weight_version for r in listed.replicas}

    async def _resync(self, gs: int, version: int, replica_ids: list[str]) -> list[str]:
        """Sync standalone replicas whose part of the step's broadcast failed again, one per group
        (:func:`~trainer_agent.driver.mesh_calls.resync_replicas`); the replicas that now hold ``version``."""
        return await resync_replicas(self.controller, gs, version, replica_ids, rpc_timeout=self._rpc_timeout,
                                     sync_timeout=self._sync_timeout)

    def _queued(self) -> int:
        """Samples (prompt groups) in the queue; it holds whole groups only."""
        return self.queue.size() // self.config.n

    async def _wait_for(self, count: int, timeout_s: float) -> tuple[float, bool]:
        """Wait until the queue holds ``count`` groups (at most ``timeout_s``); ``(waited_s, expired)``."""
        started = time.monotonic()
        deadline = started + timeout_s if timeout_s > 0 else math.inf
        while self._queued() < count:
            if self.queue.error is not None or self.queue.closed:
                break
            if time.monotonic() >= deadline:
                return time.monotonic() - started, True
            await asyncio.sleep(0.02)
        return time.monotonic() - started, False

    def _reward(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        return float(self.reward_fn(prompt_ids, completion_ids))

    def _score(self, samples: Sequence[Sample]) -> tuple[list[list[GrpoSample]], dict[str, float]]:
        """The trainer's groups with the scorer's rewards (a group id is ``prompt_id#n``)."""
        if self.scorer is None:
            raise RuntimeError("_score needs a scorer (the dataset's reward function)")
        kept = [s for s in samples if s.completion_ids]
        scores, extra = self.scorer([(s.group_id.rsplit("#", 1)[0], s.completion_ids) for s in kept])
        scored = [dataclasses.replace(s, reward=score) for s, score in zip(kept, scores)]
        return self._groups(scored), extra

    @staticmethod
    def _groups(samples: Sequence[Sample]) -> list[list[GrpoSample]]:
        """Samples by group (queue order), as the trainer's samples; empty completions are left out."""
        groups: dict[str, list[GrpoSample]] = {}
        for s in samples:
            if not s.completion_ids:
                continue
            groups.setdefault(s.group_id, []).append(GrpoSample(
                prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, rollout_logprobs=s.logprobs,
                reward=0.0 if s.reward is None else s.reward, loss_mask=s.loss_mask,
                weight_version=single_version(s)))
        return [g for g in groups.values() if g]

    def _counters(self, *, timing: dict[str, float] | None = None, wait_times: Sequence[float] = (),
                  wait_samples: Sequence[int] = (), **measured: Any) -> Counters:
        """What the step report says (:meth:`Counters.report` builds it, as for a custom trainer)."""
        cfg = self.config
        return Counters(required_samples=cfg.required_samples,
                        trigger_parameter_sync_step=cfg.trigger_parameter_sync_step,
                        staleness_threshold=cfg.staleness_threshold, generated_samples=self.queue.generated // cfg.n,
                        queued_samples=self._queued(), step_wait_times_s=list(wait_times),
                        step_wait_samples=list(wait_samples), timing_s=dict(timing or {}), **measured)


def weight_sync_summary(*syncs: Any) -> dict[str, Any]:
    """The step record's account of its weight syncs (``WeightSyncResult`` messages; unset ones are skipped)."""
    out: dict[str, Any] = {"bytes_sent": 0, "copies": {}}
    for sync in syncs:
        if not sync.sync_id:
            continue
        out["bytes_sent"] += sync.bytes_sent
        out["full_bytes"] = sync.full_bytes
        if sync.delta_base_version >= 0 and sync.delta_bytes:
            out.update(delta_base_version=sync.delta_base_version, delta_bytes=sync.delta_bytes,
                       delta_density=sync.delta_density)
        for result in sync.replica_results:
            if result.ok:
                out["copies"][result.replica_id] = {"copy": result.copy, "source": result.source}
    return out
