"""Config sections of the fully-async driver, keyed as in the reference.

The trainer agent's YAML carries them next to its server settings::

    driver:            # rollmesh's: where the mesh is, how long to train, where to write
    async_training:    # the reference's trainer-side keys (staleness_threshold, ...)
    actor_rollout_ref: # verl's actor (ppo_mini_batch_size, optim.lr) and rollout (n, ...) keys
    task:              # the built-in verifiable toy task (when no dataset is given)
    data:              # verl's data keys: a parquet/JSONL dataset (train_files, prompt_key, ...)
    custom_reward_function:  # verl's: path + name of compute_score(data_source, solution_str, ...)

Units follow verl (:mod:`mesh_runtime.samples`): a sample is one prompt with
its ``rollout.n`` responses and ``ppo_mini_batch_size`` is in prompts, so one
collection takes ``required_samples = ppo_mini_batch_size x require_batches``
samples (``x rollout.n`` responses); ``max_required_samples = int(required x
(staleness_threshold + 1) x trigger_parameter_sync_step)``. The
``async_training`` section accepts verl's whole block
(:mod:`mesh_runtime.verl_config`).
Each dataclass checks its own fields; :func:`check_driver` checks what
depends on several of them and names every key involved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal

from mesh_runtime import samples
from mesh_runtime.config import ConfigError, check_addresses, setting
from trainer_agent.training.limits import DEFAULT_LOGPROB_MISMATCH_BOUND


@dataclasses.dataclass
class DriverSettings:
    """Where the mesh is and what the driver does (rank 0 only)."""

    enabled: bool = setting(False, help="run the fully-async training driver in this agent (rank 0)")
    controller_address: str = setting("", help="HOST:PORT of the controller whose step protocol the driver calls "
                                               "(HOST:PORT,HOST:PORT,... for several controllers on one etcd "
                                               "store: the driver follows the leader)")
    load_balancer_address: str = setting("", help="HOST:PORT of the load balancer the rollouter generates "
                                                  "through, or HOST:PORT,HOST:PORT,... of several (requests "
                                                  "spread by a consistent hash of request_id); empty = the "
                                                  "balancers registered with the controller, as it lists them "
                                                  "(re-read every few seconds)")
    total_training_steps: int = setting(20, help="global steps to train (each ends with a weight sync)")
    expected_replicas: int = setting(0, help="wait until the controller lists this many replicas before the "
                                             "first step (0 = do not wait)")
    expected_routed_replicas: int = setting(1, help="wait until the load balancer routes to this many replicas "
                                                    "before the first step (0 for hybrid-only meshes)")
    start_timeout_s: float = setting(180.0, help="longest wait for the controller and the replicas at start")
    rpc_timeout_s: float = setting(60.0, help="deadline of BeginTrainingStep / ReleaseHybridReplicas")
    sync_timeout_s: float = setting(300.0, help="deadline of CompleteTrainingStep (it includes the weight syncs)")
    collect_timeout_s: float = setting(300.0, help="longest wait for one collection of samples; a step that "
                                                   "cannot collect its batch fails")
    generate_timeout_s: float = setting(120.0, help="deadline of one Generate call through the load balancer")
    replica_poll_s: float = setting(0.5, help="how often the rollouter re-reads the routed replica count")
    offload_during_hybrid: bool = setting(
        True, help="offload the trainer's parameters and optimizer state while hybrid replicas are active "
                   "(after an activation) and onload them before the next training step")
    output_dir: str = setting("", help="directory for steps.jsonl (one line per global step); empty = none",
                              path=True)
    model_output_dir: str = setting("", help="directory the trained model is written to at the end, in the "
                                             "Hugging Face format (config, safetensors, tokenizer); empty = none",
                                     path=True)
    checkpoint_dir: str = setting("", help="directory of the driver checkpoint (model, optimizer, queued and "
                                           "in-flight samples, counters); empty = no checkpoints", path=True)
    checkpoint_interval: int = setting(1, help="save a checkpoint every this many global steps")
    resume: bool = setting(True, help="at start, resume from checkpoint_dir when it holds a checkpoint")

    def validate(self) -> None:
        check_addresses(self, list_keys=("controller_address", "load_balancer_address"))
        if self.enabled:
            if not self.controller_address:
                raise ConfigError("controller_address", "is required when the driver is enabled")
        positive = ("total_training_steps", "start_timeout_s", "rpc_timeout_s", "sync_timeout_s",
                    "collect_timeout_s", "generate_timeout_s", "replica_poll_s", "checkpoint_interval")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("expected_replicas", "expected_routed_replicas"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")


@dataclasses.dataclass
class AsyncTrainingSettings:
    """verl's ``async_training`` keys the trainer side uses (any other verl key is accepted and reported)."""

    accepts_verl_async_training: ClassVar[bool] = True

    staleness_threshold: float = setting(0.1, help="allowed staleness ratio: buffer_samples = "
                                                   "step_required_samples x this")
    trigger_parameter_sync_step: int = setting(4, help="collections (GRPO updates) per weight-sync step")
    require_batches: int = setting(1, help="ppo_mini_batches per collection")
    partial_rollout: bool = setting(True, help="requests aborted on one replica resume elsewhere with their "
                                               "tokens so far (false: they are regenerated)")
    max_queue_size: int | None = setting(None, help="bound of the message queue in samples (prompts); null = "
                                                    "max_required_samples")
    concurrent_samples_per_replica: int = setting(16, help="generation requests in flight per routed replica")

    def validate(self) -> None:
        if self.staleness_threshold < 0:
            raise ConfigError("staleness_threshold", f"must be >= 0, got {self.staleness_threshold}")
        for key in ("trigger_parameter_sync_step", "require_batches", "concurrent_samples_per_replica"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.max_queue_size is not None and self.max_queue_size < 1:
            raise ConfigError("max_queue_size", f"must be >= 1 or null, got {self.max_queue_size}")


@dataclasses.dataclass
class OptimSettings:
    """``actor_rollout_ref.actor.optim``."""

    lr: float = setting(3e-3, help="AdamW learning rate")
    weight_decay: float = setting(0.0, help="AdamW weight decay")

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay}")


@dataclasses.dataclass
class ActorSettings:
    """``actor_rollout_ref.actor``."""

    ppo_mini_batch_size: int = setting(8, help="prompts per ppo_mini_batch (each sampled rollout.n times)")
    clip_ratio: float = setting(0.2, help="PPO clip of the importance ratio against the rollout logprobs")
    optim: OptimSettings = setting(default_factory=OptimSettings, help="optimizer settings")
    logprob_mismatch_bound: float = setting(
        DEFAULT_LOGPROB_MISMATCH_BOUND,
        help="largest mean absolute difference (nats per token) between the rollout logprobs of samples generated "
             "under the trainer's current weights and the trainer's own; beyond it the run stops "
             "(logprob_mismatch_action) naming the torch and transformers versions; 0 = no check")
    logprob_mismatch_action: Literal["error", "warn"] = setting(
        "error", help="error: a step over logprob_mismatch_bound stops the run before it trains; warn: log a "
                      "warning and train anyway")

    def validate(self) -> None:
        if not self.logprob_mismatch_bound >= 0:
            raise ConfigError("logprob_mismatch_bound", f"must be >= 0, got {self.logprob_mismatch_bound}")
        if self.ppo_mini_batch_size < 1:
            raise ConfigError("ppo_mini_batch_size", f"must be >= 1, got {self.ppo_mini_batch_size}")
        if not 0 < self.clip_ratio < 1:
            raise ConfigError("clip_ratio", f"must lie in (0, 1), got {self.clip_ratio}")


@dataclasses.dataclass
class MultiTurnSettings:
    """``actor_rollout_ref.rollout.multi_turn``: verl's keys (its defaults), plus ``environment`` and
    ``tool_timeout_s``. The driver's tool agent loop (:mod:`trainer_agent.driver.trajectory`) runs when
    ``enable`` is set."""

    accepts_verl_multi_turn: ClassVar[bool] = True

    enable: bool = setting(False, help="multi-turn trajectories: model turns and tool/environment turns")
    max_assistant_turns: int | None = setting(None, help="most model turns per trajectory; null = no limit")
    max_user_turns: int | None = setting(None, help="most tool/environment turns per trajectory; null = no limit")
    max_parallel_calls: int = setting(1, help="tool calls of one model turn that run (at once); later ones are "
                                              "answered with an error")
    max_tool_response_length: int = setting(256, help="longest tool response in characters; longer ones are "
                                                      "truncated")
    tool_response_truncate_side: Literal["left", "middle", "right"] = setting(
        "middle", help="what a long tool response keeps: left = its start, right = its end, middle = both ends")
    tool_config_path: str = setting("", path=True, help="verl's tool config YAML (tools: [{class_name, config, "
                                                        "tool_schema}]); empty = no tools")
    format: Literal["hermes"] = setting("hermes", help="tool-call format: hermes (<tool_call>{json}</tool_call>)")
    environment: str = setting("", help="MODULE:CLASS of an Environment that writes user turns "
                                        "(trainer_agent.driver.trajectory.Environment); empty = none")
    environment_options: dict[str, Any] = setting(default_factory=dict, help="keyword arguments of the "
                                                                             "environment's constructor")
    tool_timeout_s: float = setting(30.0, help="longest one tool call may take; past it the model gets an error "
                                               "message as the tool's response")

    def validate(self) -> None:
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, f"must be >= 1 or null, got {value}")
        if self.max_parallel_calls < 1:
            raise ConfigError("max_parallel_calls", f"must be >= 1, got {self.max_parallel_calls}")
        if self.max_tool_response_length < 1:
            raise ConfigError("max_tool_response_length", f"must be >= 1, got {self.max_tool_response_length}")
        if not self.tool_timeout_s > 0:
            raise ConfigError("tool_timeout_s", f"must be > 0, got {self.tool_timeout_s}")
        if self.tool_config_path and not Path(self.tool_config_path).is_file():
            raise ConfigError("tool_config_path", f"{self.tool_config_path[:200]!r} does not exist")
        if self.environment and ":" not in self.environment:
            raise ConfigError("environment", f"must be MODULE:CLASS, got {self.environment[:100]!r}")
        if self.enable and not self.tool_config_path and not self.environment:
            raise ConfigError("enable", "multi-turn needs tools (tool_config_path) or an environment")


@dataclasses.dataclass
class RolloutSamplingSettings:
    """``actor_rollout_ref.rollout`` (sampling side)."""

    n: int = setting(8, help="samples per prompt (the GRPO group size)")
    temperature: float = setting(1.0, help="sampling temperature (1.0 keeps the logprobs the policy's)")
    response_length: int = setting(0, help="max completion tokens; 0 = what the task's answers need")
    multi_turn: MultiTurnSettings = setting(default_factory=MultiTurnSettings, help="verl's multi-turn keys")

    def validate(self) -> None:
        if self.n < 2:
            raise ConfigError("n", f"must be >= 2 (group-normalised advantages need two samples), got {self.n}")
        if not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if self.response_length < 0:
            raise ConfigError("response_length", f"must be >= 0, got {self.response_length}")


@dataclasses.dataclass
class ActorRolloutRefSettings:
    """``actor_rollout_ref``."""

    actor: ActorSettings = setting(default_factory=ActorSettings, help="the actor (trained policy)")
    rollout: RolloutSamplingSettings = setting(default_factory=RolloutSamplingSettings, help="sampling")


@dataclasses.dataclass
class TaskSettings:
    """The built-in verifiable task (:mod:`trainer_agent.training.task`)."""

    name: str = setting("copy", help="built-in task: copy (repeat a digit string, then EOS)")
    prompts: int = setting(64, help="distinct prompts, cycled for as long as training runs")
    min_digits: int = setting(1, help="shortest digit string")
    max_digits: int = setting(1, help="longest digit string")
    radix: int = setting(10, help="digits drawn from the first radix digit tokens (2..10)")
    seed: int = setting(0, help="seed of the prompt set")

    def validate(self) -> None:
        if self.name != "copy":
            raise ConfigError("name", f"unknown task {self.name!r}; built-in tasks: copy")
        if self.prompts < 1:
            raise ConfigError("prompts", f"must be >= 1, got {self.prompts}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ConfigError("max_digits", f"need 1 <= min_digits <= max_digits, got {self.min_digits}, "
                                            f"{self.max_digits}")
        if not 2 <= self.radix <= 10:
            raise ConfigError("radix", f"must lie in [2, 10], got {self.radix}")


@dataclasses.dataclass
class DataSettings:
    """verl's ``data`` section (the keys rollmesh uses, with verl's defaults)."""

    train_files: str | list[str] = setting(default_factory=list, help="verl-format parquet or JSONL file(s); "
                                           "empty = train on the built-in task instead", path=True)
    prompt_key: str = setting("prompt", help="column holding the prompt: a chat message list or a string")
    max_prompt_length: int = setting(512, help="longest prompt in tokens (see truncation)")
    max_response_length: int = setting(512, help="most completion tokens per response")
    shuffle: bool = setting(True, help="take the prompts in a seeded random order, a new one each pass")
    seed: int = setting(1, help="seed of the shuffle")
    truncation: Literal["error", "left", "right"] = setting(
        "error", help="a prompt over max_prompt_length: error (fail naming the row), left or right (cut)")
    filter_overlong_prompts: bool = setting(False, help="drop prompts over max_prompt_length instead")

    @property
    def enabled(self) -> bool:
        return bool(self.train_files)

    def validate(self) -> None:
        for key in ("max_prompt_length", "max_response_length"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.enabled:
            from ..training.data import DatasetError, check_files  # noqa: PLC0415 - pyarrow only with a dataset

            try:
                check_files(self.train_files, self.prompt_key)
            except DatasetError as err:
                raise ConfigError("train_files", str(err)) from None


@dataclasses.dataclass
class CustomRewardSettings:
    """verl's ``custom_reward_function`` section, plus rollmesh's process pool."""

    path: str = setting("", help="Python file defining the reward function; required with a dataset", path=True)
    name: str = setting("compute_score", help="the function: compute_score(data_source, solution_str, "
                                              "ground_truth, extra_info=None) -> float or {'score': float, ...}")
    num_workers: int = setting(0, help="processes to run the reward function in (for slow ones); 0 = in the "
                                       "training thread")

    def validate(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("num_workers", f"must be >= 0, got {self.num_workers}")
        if self.path:
            from ..training.rewards import RewardFunctionError, load_function  # noqa: PLC0415

            try:
                load_function(self.path, self.name)
            except RewardFunctionError as err:
                raise ConfigError("path" if "path" in str(err) or "import" in str(err) else "name",
                                  str(err).splitlines()[0]) from None


def check_data(data: DataSettings, reward: CustomRewardSettings, *, prefix: str = "") -> None:
    """A dataset needs its reward function (verl's built-in scorers by data_source are not part of rollmesh)."""
    if data.enabled and not reward.path:
        raise ConfigError(f"{prefix}custom_reward_function.path",
                          "a dataset (data.train_files) needs a reward function: give the file defining "
                          f"{reward.name}(data_source, solution_str, ground_truth, extra_info=None)")


def required_samples(actor: ActorSettings, at: AsyncTrainingSettings) -> int:
    """Samples (prompts) per collection: ``ppo_mini_batch_size x require_batches``."""
    return samples.required_samples(actor.ppo_mini_batch_size, at.require_batches)


def max_required_samples(actor: ActorSettings, at: AsyncTrainingSettings) -> int:
    """verl's ``int(required x (staleness_threshold + 1) x trigger_parameter_sync_step)``, in prompts."""
    return samples.max_required_samples(required_samples(actor, at), at.staleness_threshold,
                                        at.trigger_parameter_sync_step)


def queue_bound(actor: ActorSettings, at: AsyncTrainingSettings) -> int:
    """``max_queue_size``, or ``max_required_samples`` when it is null (prompts)."""
    return at.max_queue_size if at.max_queue_size is not None else max_required_samples(actor, at)


def check_driver(at: AsyncTrainingSettings, arr: ActorRolloutRefSettings, *, prefix: str = "") -> None:
    """Cross-field checks: a collection and a group must fit the queue bound."""
    required = required_samples(arr.actor, at)
    bound = queue_bound(arr.actor, at)
    if required > bound:
        raise ConfigError(
            f"{prefix}async_training.max_queue_size",
            f"one collection needs {required} samples (actor_rollout_ref.actor.ppo_mini_batch_size "
            f"{arr.actor.ppo_mini_batch_size} x async_training.require_batches {at.require_batches}, prompts) "
            f"but the queue holds at most {bound}; raise async_training.max_queue_size or lower the batch")
