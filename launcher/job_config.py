"""The config of ``rollmesh train``: one YAML, keyed as in the reference, turned into every server's config.

Top-level sections (see ``examples/quickstart.yaml``)::

    model, seed, task            # what is trained, on which built-in task
    async_training               # verl's block as is (keys rollmesh does not act on are reported),
                                 # plus max_queue_size and the controller's timeouts
    actor_rollout_ref            # actor.ppo_mini_batch_size, actor.optim.lr, rollout.n,
                                 # rollout.gpu_memory_utilization, rollout.standalone_gpu_memory_utilization
    rollout                      # nnodes, n_gpus_per_node: the standalone rollout nodes
    trainer                      # nnodes, n_gpus_per_node, total_training_steps, offload_during_hybrid
    mesh                         # local-mesh settings (leases, engine batch size, timeouts)

:func:`load_job_config` checks every key (unknown keys, types, ranges) and
the combinations that cannot work - no replica at all, a collection larger
than the queue bound, more than one trainer node - and raises
:class:`~mesh_runtime.config.ConfigError` naming the keys, before anything
starts. :func:`resume_problem` says why a config cannot continue a checkpoint
(``rollmesh train --resume``). :func:`server_configs` derives the controller's, the balancer's, each
replica agent's and the trainer agent's config as plain dicts. This module
imports no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from mesh_runtime import samples
from mesh_runtime.config import ConfigError, load_config, setting
from mesh_runtime.verl_config import DEACTIVATE_WAIT_TIMEOUT_S, WEIGHT_SYNC_TIMEOUT_S
from trainer_agent.driver.settings import (
    ActorSettings,
    CustomRewardSettings,
    MultiTurnSettings,
    DataSettings,
    TaskSettings,
    check_data,
    check_driver,
    max_required_samples,
    queue_bound,
    required_samples,
)


@dataclasses.dataclass
class JobAsyncTraining:
    """``async_training``: verl's keys, for the controller and the trainer alike (any verl key is accepted)."""

    accepts_verl_async_training: ClassVar[bool] = True

    use_dynamic_resource_scheduling: bool = setting(False, help="master switch: hybrid replicas on the trainer "
                                                                "node join rollout while the trainer waits")
    dynamic_schedule_policy: str = setting("default", help="default, static_fully_async, fixed_ratio or "
                                                           "'package.module:Class'")
    dynamic_schedule_deactivate_ratio: float = setting(0.3, help="deactivate once ratio x required_samples x "
                                                                 "trigger_parameter_sync_step samples are buffered")
    dynamic_schedule_enable_rebalance: bool = setting(True, help="rebalance in-flight requests after activation")
    dynamic_schedule_policy_params: dict[str, Any] = setting(default_factory=dict, help="extra policy parameters")
    staleness_threshold: float = setting(0.1, help="buffer_samples = step_required_samples x staleness_threshold")
    trigger_parameter_sync_step: int = setting(4, help="collections per weight-sync step")
    require_batches: int = setting(1, help="ppo_mini_batches per collection")
    partial_rollout: bool = setting(True, help="aborted requests resume elsewhere with their tokens")
    max_queue_size: int | None = setting(None, help="message queue bound in samples (prompts); null = "
                                                    "max_required_samples")
    concurrent_samples_per_replica: int = setting(16, help="generation requests in flight per routed replica")
    deactivate_wait_timeout_s: float = setting(DEACTIVATE_WAIT_TIMEOUT_S,
                                               help="longest wait for buffered samples before deactivation")
    weight_sync_timeout_s: float = setting(WEIGHT_SYNC_TIMEOUT_S, help="deadline of one weight broadcast")
    sleep_level: int = setting(1, help="1 offloads hybrid weights when asleep, 2 discards them")

    def validate(self) -> None:
        from controller.core.config import SchedulingConfig  # noqa: PLC0415 - pure, no server imports
        from controller.core.errors import CoreError  # noqa: PLC0415
        from controller.core.policies import resolve_policy  # noqa: PLC0415

        try:
            SchedulingConfig(**self._scheduling_fields(1)).validate()
            resolve_policy(self.dynamic_schedule_policy)
        except CoreError as err:
            field = (getattr(err, "metadata", None) or {}).get("field", "dynamic_schedule_policy")
            raise ConfigError(field, str(err)) from None
        if self.max_queue_size is not None and self.max_queue_size < 1:
            raise ConfigError("max_queue_size", f"must be >= 1 or null, got {self.max_queue_size}")
        if self.concurrent_samples_per_replica < 1:
            raise ConfigError("concurrent_samples_per_replica", f"must be >= 1, got "
                                                                f"{self.concurrent_samples_per_replica}")

    def _scheduling_fields(self, ppo_mini_batch_size: int) -> dict[str, Any]:
        keys = ("use_dynamic_resource_scheduling", "dynamic_schedule_policy", "dynamic_schedule_deactivate_ratio",
                "dynamic_schedule_enable_rebalance", "dynamic_schedule_policy_params", "staleness_threshold",
                "trigger_parameter_sync_step", "require_batches", "deactivate_wait_timeout_s",
                "weight_sync_timeout_s", "sleep_level")
        return {**{k: getattr(self, k) for k in keys}, "ppo_mini_batch_size": ppo_mini_batch_size}


@dataclasses.dataclass
class JobRollout:
    """``actor_rollout_ref.rollout``."""

    n: int = setting(8, help="samples per prompt (GRPO group size)")
    temperature: float = setting(1.0, help="sampling temperature")
    response_length: int = setting(0, help="max completion tokens; 0 = what the task's answers need")
    gpu_memory_utilization: float = setting(0.5, help="memory fraction of HYBRID replicas (share trainer GPUs)")
    standalone_gpu_memory_utilization: float | None = setting(None, help="memory fraction of STANDALONE "
                                                                         "replicas; null = gpu_memory_utilization")
    multi_turn: MultiTurnSettings = setting(default_factory=MultiTurnSettings,
                                            help="verl's multi-turn keys: tool and environment turns")
    dtype: str = setting("auto", help="dtype the replicas serve (verl's rollout.dtype): bfloat16, float16 or "
                                      "float32; auto = the engine's own (float32 on CPU, bfloat16 on CUDA). The "
                                      "trainer keeps its weights in its own dtype and broadcasts them in this one")

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError("dtype", f"must be auto, bfloat16, float16 or float32, got {self.dtype[:20]!r}")
        if self.n < 2:
            raise ConfigError("n", f"must be >= 2 (group-normalised advantages need two samples), got {self.n}")
        if not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if self.response_length < 0:
            raise ConfigError("response_length", f"must be >= 0, got {self.response_length}")
        for key in ("gpu_memory_utilization", "standalone_gpu_memory_utilization"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {value}")


@dataclasses.dataclass
class JobActorRolloutRef:
    """``actor_rollout_ref``."""

    actor: ActorSettings = setting(default_factory=ActorSettings, help="the trained policy")
    rollout: JobRollout = setting(default_factory=JobRollout, help="sampling and replica memory")


@dataclasses.dataclass
class JobRolloutNodes:
    """``rollout``: the standalone rollout nodes (one replica agent each)."""

    nnodes: int = setting(1, help="standalone rollout nodes; 0 = hybrid only (not supported locally yet)")
    n_gpus_per_node: int = setting(2, help="replicas (GPUs, or CPU slots) per rollout node")

    def validate(self) -> None:
        if self.nnodes < 0 or self.n_gpus_per_node < 0:
            raise ConfigError("nnodes" if self.nnodes < 0 else "n_gpus_per_node", "must be >= 0")


@dataclasses.dataclass
class JobTrainer:
    """``trainer``: the trainer node (trainer agent + a replica agent hosting the hybrid replicas)."""

    nnodes: int = setting(1, help="trainer nodes (one on a local mesh)")
    n_gpus_per_node: int = setting(1, help="trainer GPUs per node; each hosts one hybrid replica")
    total_training_steps: int = setting(20, help="global steps (each ends with a weight sync)")
    offload_during_hybrid: bool = setting(True, help="offload the trainer's state while hybrids are active")
    checkpoint: bool = setting(True, help="checkpoint the model and the driver's samples after every step")

    def validate(self) -> None:
        if self.nnodes != 1:
            raise ConfigError("nnodes", f"rollmesh train runs one trainer node locally, got {self.nnodes}")
        if self.n_gpus_per_node < 0:
            raise ConfigError("n_gpus_per_node", f"must be >= 0, got {self.n_gpus_per_node}")
        if self.total_training_steps < 1:
            raise ConfigError("total_training_steps", f"must be >= 1, got {self.total_training_steps}")


@dataclasses.dataclass
class JobMesh:
    """``mesh``: settings of the local processes."""

    lease_ttl_s: float = setting(10.0, help="a node silent for this long loses its replicas")
    load_report_interval_s: float = setting(0.5, help="how often replica agents report load")
    max_batch_size: int = setting(64, help="requests a torch engine batches together")
    stream_interval: int = setting(8, help="tokens per streamed Generate chunk")
    start_timeout_s: float = setting(180.0, help="longest wait for every server and replica to come up")
    gloo_interface: str = setting("lo", help="network interface of the gloo weight broadcasts")
    weight_delta_max_ratio: float = setting(0.5, help="the trainer sends a new version as a delta from the one "
                                                      "the replicas hold when it is at most this share of the "
                                                      "full weights (the trainer agent's "
                                                      "weight_transfer.delta_max_ratio); 0 = full copies only")
    torch_threads: int = setting(1, help="OMP/MKL threads per process (CPU machines have few cores)")
    tls: bool = setting(True, help="mutual TLS between the processes, with a CA made in the run directory "
                                   "(pki/); false = plaintext on loopback")
    metrics: bool = setting(False, help="give every process a Prometheus /metrics endpoint on its own free "
                                        "port; the targets are written to prometheus_targets.json (file_sd "
                                        "format) in the run directory")

    def validate(self) -> None:
        for key in ("lease_ttl_s", "load_report_interval_s", "start_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if self.load_report_interval_s >= self.lease_ttl_s:
            raise ConfigError("load_report_interval_s", f"must be shorter than lease_ttl_s ({self.lease_ttl_s})")
        for key in ("max_batch_size", "stream_interval", "torch_threads"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.weight_delta_max_ratio <= 1:
            raise ConfigError("weight_delta_max_ratio", f"must be in [0, 1], got {self.weight_delta_max_ratio}")


@dataclasses.dataclass
class JobConfig:
    """Everything ``rollmesh train`` needs."""

    model: str = setting("tiny-llama", path="existing", help="the model the trainer and replicas share: a preset "
                                                             "(tiny-llama, tiny-qwen2) or a Hugging Face "
                                                             "directory (relative to this file)")
    seed: int = setting(0, help="model initialisation seed (trainer and replicas start from the same weights)")
    task: TaskSettings = setting(default_factory=TaskSettings, help="the built-in verifiable task")
    data: DataSettings = setting(default_factory=DataSettings, help="verl's data keys: a parquet/JSONL dataset "
                                                                    "to train on instead of the task")
    custom_reward_function: CustomRewardSettings = setting(default_factory=CustomRewardSettings,
                                                           help="verl's reward function (path, name)")
    async_training: JobAsyncTraining = setting(default_factory=JobAsyncTraining, help="the reference's keys")
    actor_rollout_ref: JobActorRolloutRef = setting(default_factory=JobActorRolloutRef, help="actor and rollout")
    rollout: JobRolloutNodes = setting(default_factory=JobRolloutNodes, help="standalone rollout nodes")
    trainer: JobTrainer = setting(default_factory=JobTrainer, help="the trainer node")
    mesh: JobMesh = setting(default_factory=JobMesh, help="local process settings")

    def validate(self) -> None:
        at, arr = self.async_training, self.actor_rollout_ref
        if self.standalone_replicas == 0 and self.hybrid_replicas == 0:
            raise ConfigError("rollout.nnodes", (
                f"no replica would generate: rollout.nnodes {self.rollout.nnodes} x rollout.n_gpus_per_node "
                f"{self.rollout.n_gpus_per_node} standalone replicas, and no hybrid replica (trainer.n_gpus_per_node "
                f"{self.trainer.n_gpus_per_node}, async_training.use_dynamic_resource_scheduling "
                f"{str(at.use_dynamic_resource_scheduling).lower()})"))
        if self.standalone_replicas == 0:
            raise ConfigError("rollout.nnodes", "hybrid-only meshes (no standalone rollout replica) are not "
                                                "supported by rollmesh train yet; set rollout.nnodes and "
                                                "rollout.n_gpus_per_node >= 1")
        check_driver(at, arr)  # type: ignore[arg-type]  # same field names as the trainer's sections
        check_data(self.data, self.custom_reward_function)

    @property
    def standalone_replicas(self) -> int:
        return self.rollout.nnodes * self.rollout.n_gpus_per_node

    @property
    def hybrid_replicas(self) -> int:
        """Hybrid replicas exist only with dynamic resource scheduling (the reference's master switch)."""
        at = self.async_training
        return self.trainer.nnodes * self.trainer.n_gpus_per_node if at.use_dynamic_resource_scheduling else 0

    @property
    def required_samples(self) -> int:
        return required_samples(self.actor_rollout_ref.actor, self.async_training)  # type: ignore[arg-type]

    @property
    def max_required_samples(self) -> int:
        return max_required_samples(self.actor_rollout_ref.actor, self.async_training)  # type: ignore[arg-type]

    @property
    def max_queue_size(self) -> int:
        return queue_bound(self.actor_rollout_ref.actor, self.async_training)  # type: ignore[arg-type]


def load_job_config(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Read and check ``path``; raises :class:`ConfigError` naming the key."""
    return load_config(JobConfig, path, overrides=overrides)


def server_configs(job: JobConfig, *, run_dir: Path, lb: str, controller: str, trainer: str) -> dict[str, dict]:
    """Every server's config as a dict: ``controller``, ``trainer-agent`` and one per replica agent.

    ``lb``, ``controller`` and ``trainer`` are the servers' addresses (the
    trainer's is where it will listen; the others are already up).
    """
    at, arr, mesh = job.async_training, job.actor_rollout_ref, job.mesh
    gpu_mem = arr.rollout.gpu_memory_utilization
    standalone_mem = arr.rollout.standalone_gpu_memory_utilization
    controller_cfg = {
        "listen": "127.0.0.1:0", "load_balancer_address": lb, "trainer_address": trainer,
        "lease_ttl_s": mesh.lease_ttl_s, "load_report_interval_s": mesh.load_report_interval_s,
        "hybrid_gpus": job.trainer.nnodes * job.trainer.n_gpus_per_node,
        "standalone_gpus": job.standalone_replicas,
        "concurrent_samples_per_replica": at.concurrent_samples_per_replica,
        # maxReq of section 4 in the rollouter's concurrency unit: generation requests (one response each)
        "max_required_samples": job.max_required_samples * arr.rollout.n,
        "async_training": {**at._scheduling_fields(arr.actor.ppo_mini_batch_size),
                           "only_hybrid": job.standalone_replicas == 0},
    }
    agent_common = {
        "listen": "127.0.0.1:0", "controller_address": controller, "model": job.model, "model_seed": job.seed,
        "stream_interval": mesh.stream_interval, "gpu_memory_utilization": gpu_mem,
        "standalone_gpu_memory_utilization": standalone_mem,
        "weight_transfer": {"gloo_interface": mesh.gloo_interface},
        "engine_options": {"max_batch_size": mesh.max_batch_size,
                           **({"dtype": arr.rollout.dtype} if arr.rollout.dtype != "auto" else {})},
    }
    configs: dict[str, dict] = {"controller": controller_cfg}
    for node in range(job.rollout.nnodes):
        configs[f"rollout-{node}"] = {
            **agent_common, "node_id": f"rollout-{node}", "slots": max(1, job.rollout.n_gpus_per_node),
            "replicas": [{"replica_id": f"s{node}-{i}", "kind": "STANDALONE"}
                         for i in range(job.rollout.n_gpus_per_node)]}
    if job.hybrid_replicas:
        configs["trainer-0-replicas"] = {
            **agent_common, "node_id": "trainer-0", "slots": job.trainer.n_gpus_per_node,
            "replicas": [{"replica_id": f"h{i}", "kind": "HYBRID"} for i in range(job.trainer.n_gpus_per_node)]}
    configs["trainer-agent"] = {
        "listen": trainer, "node_id": "trainer-0", "model": job.model, "model_seed": job.seed,
        "served_dtype": arr.rollout.dtype if arr.rollout.dtype != "auto" else "",
        "weight_transfer": {"gloo_interface": mesh.gloo_interface, "delta_max_ratio": mesh.weight_delta_max_ratio},
        "driver": {
            "enabled": True, "controller_address": controller, "load_balancer_address": lb,
            "total_training_steps": job.trainer.total_training_steps,
            "expected_replicas": job.standalone_replicas + job.hybrid_replicas,
            "expected_routed_replicas": job.standalone_replicas, "start_timeout_s": mesh.start_timeout_s,
            "sync_timeout_s": max(300.0, 3 * at.weight_sync_timeout_s),
            "offload_during_hybrid": job.trainer.offload_during_hybrid,
            "output_dir": str(run_dir / "trainer"),
            "model_output_dir": str(run_dir / "model"),
            "checkpoint_dir": str(run_dir / "checkpoint") if job.trainer.checkpoint else "",
        },
        "async_training": {k: getattr(at, k) for k in (
            "staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout",
            "max_queue_size", "concurrent_samples_per_replica")},
        "actor_rollout_ref": {"actor": dataclasses.asdict(arr.actor),
                              "rollout": {"n": arr.rollout.n, "temperature": arr.rollout.temperature,
                                          "response_length": arr.rollout.response_length,
                                          "multi_turn": _multi_turn(arr.rollout.multi_turn)}},
        "task": dataclasses.asdict(job.task),
        "data": {**dataclasses.asdict(job.data),
                 "train_files": [str(Path(f).resolve()) for f in
                                 ([job.data.train_files] if isinstance(job.data.train_files, str)
                                  else job.data.train_files)]},
        "custom_reward_function": {**dataclasses.asdict(job.custom_reward_function),
                                   "path": str(Path(job.custom_reward_function.path).resolve())
                                   if job.custom_reward_function.path else ""},
    }
    return configs


def _multi_turn(settings: MultiTurnSettings) -> dict[str, Any]:
    """The trainer agent's ``multi_turn`` section: the job's, with the tool config's path made absolute."""
    out = dataclasses.asdict(settings)
    if settings.tool_config_path:
        out["tool_config_path"] = str(Path(settings.tool_config_path).resolve())
    return out


def describe_job(job: JobConfig) -> str:
    """One line: the mesh this config starts and the batch arithmetic."""
    at = job.async_training
    step_required = samples.step_required_samples(job.required_samples, at.trigger_parameter_sync_step)
    buffer = samples.buffer_samples(step_required, at.staleness_threshold)
    return (f"{job.standalone_replicas} standalone + {job.hybrid_replicas} hybrid replica(s); "
            f"{job.trainer.total_training_steps} steps x {at.trigger_parameter_sync_step} collection(s) of "
            f"{job.required_samples} samples (prompts, x {job.actor_rollout_ref.rollout.n} responses); "
            f"buffer {buffer:g}, "
            f"queue bound {job.max_queue_size}; policy {at.dynamic_schedule_policy}"
            f"{'' if at.use_dynamic_resource_scheduling else ' (dynamic scheduling off)'}")


def resume_problem(job: JobConfig, info: Any, run_dir: Path) -> str | None:
    """Why ``job`` cannot continue the checkpoint ``info`` (a ``CheckpointInfo``, None = none); None if it can.

    What must match is what the checkpoint's contents depend on: the model
    preset (its parameters), the task (the queued samples, the unfinished
    groups and the prompt position are of its prompts) and ``rollout.n`` (the
    groups' size). Anything else (learning rate, staleness, replicas, seed:
    the weights come from the checkpoint) may change between the two parts.
    """
    if info is None:
        return (f"{run_dir} holds no checkpoint ({run_dir / 'checkpoint' / 'driver.pt'} is missing); nothing to "
                f"resume (start a new run with another --run-dir)")
    if not job.trainer.checkpoint:
        return "trainer.checkpoint is false; a resumed run reads and extends the checkpoint, set it to true"
    saved = info.job
    if saved.get("model") not in (None, job.model):
        return (f"model {job.model!r} differs from the checkpoint's {saved['model']!r}; the checkpoint's weights "
                f"fit only its model")
    task = dataclasses.asdict(job.task)
    changed = [f"task.{k} {task[k]!r} (checkpoint: {v!r})" for k, v in (saved.get("task") or {}).items()
               if k in task and task[k] != v]
    if changed:
        return (f"{', '.join(changed)} differ from the checkpoint's task; its queued samples, unfinished groups "
                f"and prompt position belong to that task")
    n = job.actor_rollout_ref.rollout.n
    if saved.get("rollout_n") not in (None, n):
        return (f"actor_rollout_ref.rollout.n {n} differs from the checkpoint's {saved['rollout_n']}; its queued "
                f"and unfinished groups have {saved['rollout_n']} samples each")
    total = job.trainer.total_training_steps
    if info.global_step >= total:
        return (f"{run_dir} already reached step {info.global_step} of trainer.total_training_steps {total}; "
                f"pass --steps N with N > {info.global_step} to train further")
    return None
