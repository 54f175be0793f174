"""The training driver inside ``rollmesh trainer-agent`` (rank 0).

:class:`TrainingDriver` assembles the fully-async loop from the agent's
config and runs it as a background task of the server:

1. opens channels to the controller and the load balancer and waits (at most
   ``driver.start_timeout_s``) until the controller lists
   ``expected_replicas`` replicas and the balancer routes to
   ``expected_routed_replicas``;
2. builds the GRPO trainer on the model the agent's weight source holds (so
   every update is what the next broadcast sends), the rollouter's config from
   ``async_training`` / ``actor_rollout_ref`` and the task's prompts;
3. resumes from ``driver.checkpoint_dir`` when it holds a checkpoint (the
   model, AdamW state, queued samples, unfinished groups and counters; a
   ``resumed`` line in ``steps.jsonl``) and, when the restored weight
   version is above 0, brings every replica to it through the controller's
   ``SyncWeights`` before the rollouter starts (a ``replicas_synced`` line):
   fresh replica processes hold the initial weights;
4. runs the steps left up to ``total_training_steps``; after each one it
   appends the step to ``<output_dir>/steps.jsonl`` and saves a checkpoint
   (the step line is written first, so a run stopped in between resumes at
   that step again and its ``resumed`` line supersedes the later lines).

``progress()`` answers GetTrainingProgress. A failure anywhere (rollouter,
controller call, training) ends the run in state ``FAILED`` with the error's
text, never as a normal end (known weakness 16); the agent keeps serving so
the failure can be read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mesh_runtime.channels import as_channel, open_channel, read_methods
from mesh_runtime.hash_ring import open_balancer_channel
from mesh_runtime.discovery import open_discovered_balancers
from mesh_runtime.generate_many import BalancerGenerations
from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc

from ..training import task as copy_task
from ..training.grpo import GrpoConfig, GrpoTrainer, parameter_bytes
from .checkpoint import load_checkpoint, save_checkpoint
from .lb_client import LoadBalancerGenerate
from .loop import FullyAsyncLoop, Scorer, StepRecord, task_prompts
from .mesh_calls import lb_replica_count
from .rollouter import Prompt, RolloutConfig
from .settings import queue_bound

if TYPE_CHECKING:
    from .tools import ToolBox
    from .trajectory import TrajectoryRunner

log = logging.getLogger(__name__)

STATES = ("IDLE", "WAITING_FOR_SAMPLES", "TRAINING", "SYNCING_WEIGHTS", "FINISHED", "FAILED")
_PHASE_STATE = {"waiting": "WAITING_FOR_SAMPLES", "training": "TRAINING", "syncing": "SYNCING_WEIGHTS"}


@dataclasses.dataclass(frozen=True)
class Progress:
    """What GetTrainingProgress reports."""

    global_step: int
    weight_version: int
    param_version: int
    samples_generated: int
    samples_consumed: int
    samples_dropped: int
    queue_size: int
    last_reward_mean: float | None
    state: str
    error_message: str
    final_step: int


@dataclasses.dataclass(frozen=True)
class Moved:
    """Result of an offload or onload."""

    bytes_moved: int
    duration_s: float


class TrainingDriver:
    """Runs the fully-async loop for the trainer agent; see the module docstring."""

    def __init__(self, config: Any, source: Any, tracer_provider: Any = None) -> None:
        self.config = config
        self.settings = config.driver
        self.source = source
        self._tracer_provider = tracer_provider
        self.state = "IDLE"
        self.error_message = ""
        self.trainer: GrpoTrainer | None = None
        self.loop: FullyAsyncLoop | None = None
        self.records: list[StepRecord] = []
        self.resumed_from_step = 0
        self._controller: Any = None
        self._scorer: Any = None
        self._rows: dict[str, Any] = {}   # the dataset's rows by prompt id (multi-turn context)
        self._stop_after: int | None = None   # StopTraining's step; None: total_training_steps

    # -- GetTrainingProgress / offload ------------------------------------------------------------

    def progress(self) -> Progress:
        q = self.loop.queue if self.loop is not None else None
        last = self.records[-1] if self.records else None
        return Progress(
            global_step=last.global_step if last else 0,
            weight_version=last.weight_version if last else self.source.weight_version,
            param_version=self.trainer.weight_version if self.trainer else self.source.weight_version,
            samples_generated=q.generated if q else 0, samples_consumed=q.consumed if q else 0,
            samples_dropped=q.dropped if q else 0, queue_size=q.size() if q else 0,
            last_reward_mean=last.reward_mean if last else None, state=self.state,
            error_message=self.error_message, final_step=self.final_step)

    @property
    def final_step(self) -> int:
        """The step training ends after: total_training_steps, or the step a stop request chose."""
        total = self.settings.total_training_steps
        return total if self._stop_after is None else min(self._stop_after, total)

    def stop(self, after_step: int | None) -> int:
        """End training after ``after_step`` (None: the step running now, or before any further step while
        none runs); the latest call wins. Returns the step training ends after."""
        if not self.settings.enabled:
            raise FailedPrecondition("this agent runs no training loop (driver.enabled is false); nothing to stop",
                                     reason=Reason.NO_TRAINING_LOOP)
        if self.state in ("FINISHED", "FAILED"):
            raise FailedPrecondition(f"training has ended already (state {self.state}); there is nothing to stop",
                                     reason=Reason.TRAINING_ENDED)
        total = self.settings.total_training_steps
        if after_step is not None and not 1 <= after_step <= total:
            raise InvalidArgument(f"after_step must be within 1..{total} (trainer.total_training_steps), got "
                                  f"{after_step}", reason=Reason.INVALID_STOP_STEP)
        finished = self.records[-1].global_step if self.records else 0
        running = finished + 1 if self.loop is not None else None   # the loop starts its next step at once
        if after_step is None:
            after_step = running if running is not None else finished
        elif running is not None and after_step < running:
            raise FailedPrecondition(f"step {running} is running already; training can end after step {running} "
                                     f"at the earliest, not after step {after_step}",
                                     reason=Reason.STEP_ALREADY_PASSED, metadata={"running_step": str(running)})
        self._stop_after = after_step
        if self.loop is not None:
            self.loop.last_step = after_step
        log.info("stop requested: training ends after step %d", after_step)
        self._write_line({"event": "stop_requested", "final_step": after_step, "time": time.time()})
        return after_step

    async def offload(self, include_optimizer: bool) -> Moved:
        trainer = self._idle_trainer("offload")
        if trainer.offloaded:
            return Moved(0, 0.0)
        started = time.perf_counter()
        moved = parameter_bytes(trainer.model) + (trainer.optimizer_state_bytes() if include_optimizer else 0)
        await asyncio.to_thread(trainer.offload, include_optimizer=include_optimizer)
        return Moved(moved, time.perf_counter() - started)

    async def onload(self) -> Moved:
        trainer = self._idle_trainer("onload")
        if not trainer.offloaded:
            return Moved(0, 0.0)
        started = time.perf_counter()
        moved = trainer.offloaded_bytes()
        await asyncio.to_thread(trainer.onload)
        return Moved(moved, time.perf_counter() - started)

    def _idle_trainer(self, what: str) -> GrpoTrainer:
        if self.trainer is None:
            raise FailedPrecondition(f"no training loop runs on this agent yet; nothing to {what}",
                                     reason=Reason.NO_TRAINING_LOOP)
        if self.state in ("TRAINING", "SYNCING_WEIGHTS"):
            raise FailedPrecondition(f"a training step is running (state {self.state}); {what} between steps",
                                     reason=Reason.TRAINING_STEP_RUNNING)
        return self.trainer

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Train; never raises except on cancellation (the outcome is in ``state``)."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - recorded and reported as FAILED
            self.state = "FAILED"
            self.error_message = _describe(err)
            log.error("training failed: %s", self.error_message, exc_info=err)
            self._write_line({"event": "failed", "error": self.error_message})
            return
        if self.settings.model_output_dir:
            try:
                from ..training.export import export_model  # noqa: PLC0415

                written = await asyncio.to_thread(export_model, self.source, self.settings.model_output_dir)
            except Exception as err:  # noqa: BLE001 - a run whose model cannot be written did not finish
                self.state = "FAILED"
                self.error_message = f"writing the trained model to {self.settings.model_output_dir} failed: {err!r}"
                log.error("%s", self.error_message)
                self._write_line({"event": "failed", "error": self.error_message})
                return
            log.info("trained model (weight version %d) written to %s", self.source.weight_version, written)
            self._write_line({"event": "model_written", "path": str(written),
                              "weight_version": self.source.weight_version})
        self.state = "FINISHED"
        log.info("training finished after %d steps", len(self.records))
        self._write_line({"event": "finished", "steps": len(self.records)})

    async def _run(self) -> None:
        s = self.settings
        tls = getattr(self.config, "tls", None)   # the agent's own identity (role trainer-agent)
        ctl_channel = open_channel(s.controller_address, tls=tls, tracer_provider=self._tracer_provider,
                                   idempotent=read_methods())
        if s.load_balancer_address:
            lb_channel = open_balancer_channel(s.load_balancer_address, tls=tls, tracer_provider=self._tracer_provider,
                                               idempotent=read_methods())
        else:   # the balancers registered with the controller
            lb_channel = as_channel(await open_discovered_balancers(
                s.controller_address, tls=tls, tracer_provider=self._tracer_provider, idempotent=read_methods(),
                timeout_s=s.start_timeout_s))
        generations = BalancerGenerations(lb_channel)   # the rollouts on GenerateMany streams
        try:
            controller = controller_pb2_grpc.ControllerServiceStub(ctl_channel)
            balancer = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lb_channel)
            self._controller = controller
            await self._wait_for_mesh(controller, balancer)
            self.loop = self._build_loop(controller, balancer, generations)
            self.loop.last_step = self._stop_after
            checkpoint = load_checkpoint(s.checkpoint_dir) if s.checkpoint_dir and s.resume else None
            if checkpoint is not None:
                self._restore(checkpoint)
                if self.trainer is not None and self.trainer.weight_version > 0:
                    await self._sync_replicas_after_restore()
            remaining = s.total_training_steps - (self.loop.next_step - 1)
            if remaining > 0:
                await self.loop.run(remaining)
            if self.trainer is not None and self.trainer.offloaded:
                await asyncio.to_thread(self.trainer.onload)
        finally:
            if self._scorer is not None:
                self._scorer.close()
            await ctl_channel.close()
            await generations.close()
            await lb_channel.close()

    async def _wait_for_mesh(self, controller: Any, balancer: Any) -> None:
        s = self.settings
        count_routed = lb_replica_count(balancer, timeout_s=5.0)
        deadline = time.monotonic() + s.start_timeout_s
        last = "nothing answered yet"
        while True:
            try:
                listed = await controller.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=5.0)
                routed = await count_routed()
                if len(listed.replicas) >= s.expected_replicas and routed >= s.expected_routed_replicas:
                    log.info("mesh ready: %d replicas registered, %d routed", len(listed.replicas), routed)
                    return
                last = (f"{len(listed.replicas)}/{s.expected_replicas} replicas registered, "
                        f"{routed}/{s.expected_routed_replicas} routed")
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the mesh was not ready within {s.start_timeout_s:.0f} s ({last})")
            await asyncio.sleep(0.2)

    def _build_loop(self, controller: Any, balancer: Any,
                    generations: BalancerGenerations | None = None) -> FullyAsyncLoop:
        s, at, arr, t = self.settings, self.config.async_training, self.config.actor_rollout_ref, self.config.task
        actor, sampling = arr.actor, arr.rollout
        scorer: Scorer | None = None
        stop_ids: tuple[int, ...] = ()
        toolbox = self._toolbox()
        if self.config.data.enabled:
            prompts, scorer, stop_ids = self._dataset(tools=toolbox.schemas if toolbox is not None else None)
            max_tokens = sampling.response_length or self.config.data.max_response_length
        else:
            prompts = task_prompts(copy_task, t.prompts, t.seed, min_digits=t.min_digits, max_digits=t.max_digits,
                                   radix=t.radix)
            max_tokens = sampling.response_length or t.max_digits + 1  # the digits, then EOS
        rollout = RolloutConfig(
            n=sampling.n, ppo_mini_batch_size=actor.ppo_mini_batch_size, require_batches=at.require_batches,
            trigger_parameter_sync_step=at.trigger_parameter_sync_step, staleness_threshold=at.staleness_threshold,
            concurrent_samples_per_replica=at.concurrent_samples_per_replica, partial_rollout=at.partial_rollout,
            max_tokens=max_tokens, temperature=sampling.temperature, stop_token_ids=stop_ids)
        self.trainer = GrpoTrainer.from_weight_source(self.source, GrpoConfig(
            lr=actor.optim.lr, weight_decay=actor.optim.weight_decay, clip_ratio=actor.clip_ratio,
            temperature=sampling.temperature, logprob_mismatch_bound=actor.logprob_mismatch_bound,
            logprob_mismatch_action=actor.logprob_mismatch_action))
        trajectory = self._trajectories(balancer, toolbox, max_tokens).run if sampling.multi_turn.enable else None
        return FullyAsyncLoop(
            controller, LoadBalancerGenerate(balancer, timeout_s=s.generate_timeout_s, generations=generations),
            self.trainer, rollout,
            prompts, copy_task.reward, replica_count=lb_replica_count(balancer),
            max_queue_size=queue_bound(actor, at), rpc_timeout_s=s.rpc_timeout_s,
            sync_timeout_s=s.sync_timeout_s, collect_timeout_s=s.collect_timeout_s, replica_poll_s=s.replica_poll_s,
            on_step=self._after_step, on_phase=self._phase, offload_during_hybrid=s.offload_during_hybrid,
            scorer=scorer, trajectory=trajectory)

    def _toolbox(self) -> ToolBox | None:
        """The multi-turn tools of ``multi_turn.tool_config_path`` (verl's tool config), or None."""
        mt = self.config.actor_rollout_ref.rollout.multi_turn
        if not (mt.enable and mt.tool_config_path):
            return None
        from .tools import ToolBox, load_tools  # noqa: PLC0415

        return ToolBox(load_tools(mt.tool_config_path), timeout_s=mt.tool_timeout_s,
                       max_response_length=mt.max_tool_response_length, truncate_side=mt.tool_response_truncate_side)

    def _trajectories(self, balancer: Any, toolbox: ToolBox | None, max_tokens: int) -> TrajectoryRunner:
        """The multi-turn runner: the model's chat template, the tools, the environment, CloseSession."""
        from mesh_runtime.chat import ChatTokenizer  # noqa: PLC0415
        from rollmesh.loadbalancer.v1 import loadbalancer_pb2  # noqa: PLC0415

        from .trajectory import TrajectoryRunner, load_environment  # noqa: PLC0415

        mt = self.config.actor_rollout_ref.rollout.multi_turn
        environment = load_environment(mt.environment, mt.environment_options) if mt.environment else None
        timeout_s = self.settings.rpc_timeout_s

        async def close_session(session_id: str) -> None:
            await balancer.CloseSession(loadbalancer_pb2.CloseSessionRequest(session_id=session_id), timeout=timeout_s)

        def context_of(prompt_id: str) -> dict[str, Any]:
            row = self._rows.get(prompt_id)
            if row is None:
                return {}
            return {"messages": [dict(m) for m in row.messages], "extra_info": row.extra_info,
                    "ground_truth": row.ground_truth}

        return TrajectoryRunner(ChatTokenizer.from_model(self.config.model), mt, max_response_tokens=max_tokens,
                                toolbox=toolbox, environment=environment, close_session=close_session,
                                context_of=context_of)

    def _dataset(self, tools: list[dict[str, Any]] | None = None
                 ) -> tuple[Iterator[Prompt], Scorer, tuple[int, ...]]:
        """Prompts, scorer and stop tokens of the configured verl-format dataset and reward function."""
        from modeling.tokenizer import load_tokenizer  # noqa: PLC0415 - transformers, only with a dataset

        from ..training.data import load_dataset, prompt_order  # noqa: PLC0415
        from ..training.rewards import RewardScorer  # noqa: PLC0415

        data, reward = self.config.data, self.config.custom_reward_function
        tokenizer = load_tokenizer(self.config.model)
        rows = load_dataset(data.train_files, tokenizer, prompt_key=data.prompt_key,
                            max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                            filter_overlong_prompts=data.filter_overlong_prompts, tools=tools)
        by_id = self._rows = {r.prompt_id: r for r in rows}
        self._scorer = RewardScorer(reward.path, reward.name, tokenizer, num_workers=reward.num_workers)
        log.info("dataset: %d prompts from %s; reward %s from %s", len(rows), data.train_files, reward.name,
                 reward.path)

        def score(items: Sequence[tuple[str, Sequence[int]]]) -> tuple[list[float], dict[str, float]]:
            return self._scorer.score([(by_id[prompt_id], ids) for prompt_id, ids in items])

        prompts = (Prompt(r.prompt_id, list(r.token_ids)) for r in prompt_order(rows, shuffle=data.shuffle,
                                                                                 seed=data.seed))
        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        return prompts, score, stop

    def _restore(self, checkpoint: dict) -> None:
        assert self.trainer is not None and self.loop is not None
        self.trainer.load_state_dict(checkpoint["trainer"])
        self.loop.load_state_dict(checkpoint["driver"])
        self.records = [StepRecord(**r) for r in checkpoint["records"]]
        self.loop.records = list(self.records)
        self.resumed_from_step = self.loop.next_step - 1
        log.info("resumed from the checkpoint of step %d (weight version %d, %d samples queued, %d groups "
                 "admitted and unfinished)", self.resumed_from_step, self.trainer.weight_version,
                 self.loop.queue.size(), len(checkpoint["driver"]["rollouter"]["pending"]))
        q = self.loop.queue
        self._write_line({"event": "resumed", "global_step": self.resumed_from_step,
                          "weight_version": self.trainer.weight_version, "queue_size": q.size(),
                          "pending_groups": len(checkpoint["driver"]["rollouter"]["pending"]),
                          "generated": q.generated, "consumed": q.consumed, "dropped": q.dropped,
                          "time": time.time()})

    async def _sync_replicas_after_restore(self) -> None:
        assert self.trainer is not None and self.loop is not None
        self.state = "SYNCING_WEIGHTS"
        version = self.trainer.weight_version
        versions = await self.loop.bring_replicas_to(version)
        log.info("replicas brought to the checkpoint's weight version %d: %s", version, versions)
        self._write_line({"event": "replicas_synced", "global_step": self.resumed_from_step,
                          "weight_version": version, "replicas": versions, "time": time.time()})

    def _phase(self, phase: str) -> None:
        self.state = _PHASE_STATE[phase]

    async def _after_step(self, record: StepRecord) -> None:
        assert self.loop is not None and self.trainer is not None
        self.records.append(record)
        replicas = await self._controller.ListReplicas(registry_pb2.ListReplicasRequest(),
                                                       timeout=self.settings.rpc_timeout_s)
        self._write_line({"event": "step", **dataclasses.asdict(record), "trainer_param_version":
                          self.trainer.weight_version, "replicas": {
                              r.replica_id: {"state": types_pb2.ReplicaState.Name(r.state),
                                             "weight_version": r.weight_version} for r in replicas.replicas}})
        s = self.settings
        last = record.global_step == self.final_step   # the run's last step is always checkpointed
        if s.checkpoint_dir and (record.global_step % s.checkpoint_interval == 0 or last):
            trainer_state = self.trainer.state_dict()
            driver_state = self.loop.state_dict()
            records = list(self.records)
            await asyncio.to_thread(save_checkpoint, s.checkpoint_dir, trainer_state=trainer_state,
                                    driver_state=driver_state, records=records, job=self._job_identity())
        log.info("step %d: weight version %d, reward %.3f, queue %d, generated %d consumed %d dropped %d",
                 record.global_step, record.weight_version, record.reward_mean, record.queue_size,
                 record.generated, record.consumed, record.dropped)

    def _job_identity(self) -> dict[str, Any]:
        """What a resumed run must share with this one (``rollmesh train --resume`` checks it)."""
        return {"model": self.config.model, "task": dataclasses.asdict(self.config.task),
                "rollout_n": self.config.actor_rollout_ref.rollout.n}

    def _write_line(self, data: dict) -> None:
        if not self.settings.output_dir:
            return
        path = Path(self.settings.output_dir) / "steps.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(json.dumps(data) + "\n")


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{type(err).__name__}: {err.code().name}: {err.details()}"
    text = f"{type(err).__name__}: {err}"
    cause = err.__cause__
    if cause is not None:
        text += f" (caused by {_describe(cause)})"
    return text
