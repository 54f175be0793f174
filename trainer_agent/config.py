"""Configuration of ``rollmesh trainer-agent``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from mesh_runtime.config import ConfigError, ServerConfig, check_addresses, setting
from mesh_runtime.net import AddressError, is_loopback, parse_host_port
from modeling.model_names import is_model_directory
from weight_transfer import WeightTransferConfig

from .driver.settings import (
    ActorRolloutRefSettings,
    AsyncTrainingSettings,
    CustomRewardSettings,
    DataSettings,
    DriverSettings,
    TaskSettings,
    check_data,
    check_driver,
)

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class TrainerAgentConfig(ServerConfig):
    """Settings of the trainer agent (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50054", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    training_backend: Literal["torch", "megatron"] = setting(
        "torch", help="training engine that holds the weights: torch, or megatron (megatron-core's GPT built "
                      "from the model's Hugging Face config; training needs device cuda)")
    model: str = setting("tiny-llama", help="model: a built-in preset name (tiny-llama, tiny-qwen2, "
                                            "small-llama) or a local Hugging Face directory (config.json + "
                                            "safetensors); must be what the replicas serve")
    model_seed: int = setting(0, help="initialisation seed of a preset model (same seed = same weights)")
    initial_weight_version: int = setting(0, help="weight version of the weights loaded at start, e.g. the "
                                                  "step of the checkpoint being resumed")
    weight_source: str = setting("", help="a WeightSource subclass by import path (package.module:Class) "
                                          "that holds the weights to broadcast instead of the training "
                                          "backend, e.g. trainer_agent.published_weights:DirectoryWeightSource "
                                          "for a trainer process of your own")
    weight_source_options: dict[str, Any] = setting(default_factory=dict, help="keyword arguments of the "
                                                    "weight_source class (e.g. {directory: /shared/weights})")
    adopt_requested_versions: bool = setting(
        False, help="off (default): a version is never attached to weights that did not change, so a "
                    "PrepareWeightSync for a version the weight source does not hold fails with "
                    "FAILED_PRECONDITION; on (test meshes without a trainer): with no training loop here, a "
                    "prepare for the next version (the trainer's + 1) publishes the current weights under it")
    weight_dtype: Literal["float32", "bfloat16", "float16"] = setting(
        "float32", help="dtype the weights are held and broadcast in; must match the replicas' engine dtype "
                        "(torch engine: float32 on CPU, bfloat16 on CUDA)")
    served_dtype: Literal["", "float32", "bfloat16", "float16"] = setting(
        "", help="dtype floating-point weights are broadcast in when it differs from weight_dtype: the "
                 "replicas' engine dtype, e.g. bfloat16 replicas of a trainer that keeps float32 weights; "
                 "empty = weight_dtype")
    device: str = setting("cpu", help="device the weights live on: cpu, cuda or cuda:N")
    metrics_listen: str = setting("", help="HOST:PORT for a Prometheus /metrics endpoint; empty = off")
    weight_rendezvous: str = setting(
        "127.0.0.1:0", help="HOST:PORT of the rendezvous store this trainer hosts for weight broadcasts: "
                            "receivers connect to HOST (it must be reachable from the replica nodes); port "
                            "0 = a free port picked once at start")
    weight_transfer_timeout_s: float = setting(300.0, help="default timeout of a weight broadcast when the "
                                                            "sync plan gives none")
    weight_transfer: WeightTransferConfig = setting(
        default_factory=WeightTransferConfig,
        help="weight-transfer settings; topology, gloo_interface and checksum_algorithm must agree with the "
             "replicas'")
    driver: DriverSettings = setting(default_factory=DriverSettings,
                                     help="the fully-async training driver (rank 0): mesh addresses, steps, outputs")
    async_training: AsyncTrainingSettings = setting(default_factory=AsyncTrainingSettings,
                                                    help="the reference's async_training keys (trainer side)")
    actor_rollout_ref: ActorRolloutRefSettings = setting(default_factory=ActorRolloutRefSettings,
                                                         help="actor (ppo_mini_batch_size, optim.lr) and rollout "
                                                              "(n, temperature) settings")
    task: TaskSettings = setting(default_factory=TaskSettings, help="the built-in verifiable task to train on")
    data: DataSettings = setting(default_factory=DataSettings, help="verl's data keys: a dataset to train on "
                                                                    "instead of the task")
    custom_reward_function: CustomRewardSettings = setting(default_factory=CustomRewardSettings,
                                                           help="verl's reward function keys (with a dataset)")

    def validate(self) -> None:
        super().validate()
        check_addresses(self, listen_keys=("metrics_listen",))
        try:
            host, _ = parse_host_port(self.weight_rendezvous)
        except AddressError as err:
            raise ConfigError("weight_rendezvous", str(err)) from None
        if host in ("0.0.0.0", "::"):
            raise ConfigError("weight_rendezvous", f"HOST is what receivers connect to, so it must be an "
                                                   f"address they can reach, not the wildcard {host!r}")
        if is_loopback(host) and not is_loopback(parse_host_port(self.listen)[0]):
            raise ConfigError("weight_rendezvous", f"{self.weight_rendezvous!r} is a loopback address, but this "
                                                   f"trainer serves on {self.listen!r}: replicas on other "
                                                   "machines could not reach its weight broadcasts; give the "
                                                   "address they reach this machine at")
        if not self.model:
            raise ConfigError("model", "must name a preset or a local Hugging Face directory")
        if is_model_directory(self.model):
            if not (Path(self.model) / "config.json").is_file():
                raise ConfigError("model", f"{self.model!r} is not a directory with a config.json")
        else:
            from modeling.presets import PRESETS  # noqa: PLC0415 - no transformers import

            if self.model not in PRESETS:
                raise ConfigError("model", f"unknown preset {self.model!r}; known presets: {sorted(PRESETS)} "
                                           "(a local directory needs a '/' in its path)")
        if self.initial_weight_version < 0:
            raise ConfigError("initial_weight_version", f"must be >= 0, got {self.initial_weight_version}")
        if self.device != "cpu" and not (self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError("device", f"must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.training_backend == "megatron":
            if not _megatron_available():
                raise ConfigError("training_backend", "megatron needs megatron-core (pip install 'rollmesh[megatron]')")
            if self.driver.enabled and self.device == "cpu":
                raise ConfigError("device", "megatron-core's forward pass needs CUDA: training with "
                                            "training_backend megatron needs device cuda (use the torch backend "
                                            "on CPU)")
        if self.weight_source:
            from .weight_source import load_source_class  # noqa: PLC0415 - imports the named module

            try:
                load_source_class(self.weight_source)
            except (ImportError, AttributeError, TypeError, ValueError) as err:
                raise ConfigError("weight_source", str(err)) from None
            if self.driver.enabled:
                raise ConfigError("weight_source", "a weight_source holds weights trained elsewhere; the driver "
                                                   "trains its own (driver.enabled: false with a weight_source)")
        if self.weight_transfer_timeout_s <= 0:
            raise ConfigError("weight_transfer_timeout_s", f"must be > 0, got {self.weight_transfer_timeout_s}")
        check_driver(self.async_training, self.actor_rollout_ref)
        check_data(self.data, self.custom_reward_function)


def _megatron_available() -> bool:
    try:
        import megatron.core  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True
