"""Configuration of ``rollmesh replica-agent``."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from mesh_runtime.config import ConfigError, ServerConfig, check_addresses, setting
from mesh_runtime.net import is_wildcard, parse_host_port
from modeling.model_names import is_model_directory

Kind = Literal["STANDALONE", "HYBRID"]


@dataclasses.dataclass
class BootReplica:
    """A replica the agent starts when it boots (an "initial" replica)."""

    replica_id: str = setting("", help="id of the replica; empty = '<node_id>-r<index>'")
    kind: Kind = setting("STANDALONE", help="STANDALONE (dedicated rollout GPUs) or HYBRID (shares trainer GPUs)")
    slots: int = setting(1, help="slots (GPUs, or CPU slots) the replica occupies")
    start_asleep: bool | None = setting(None, help="start sleeping with memory released; "
                                                   "default: true for HYBRID, false for STANDALONE")

    def validate(self) -> None:
        if self.slots < 1:
            raise ConfigError("slots", f"must be >= 1, got {self.slots}")

    @property
    def asleep_at_boot(self) -> bool:
        return self.kind == "HYBRID" if self.start_asleep is None else self.start_asleep


@dataclasses.dataclass
class ReplicaAgentConfig(ServerConfig):
    """Settings of the replica agent (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50053", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    advertise_address: str = setting("", help="HOST:PORT other servers use to reach this agent; "
                                              "empty = the address it listens on")
    controller_address: str = setting("", help="HOST:PORT of the controller to register with and keep a "
                                               "lease on, or HOST:PORT,HOST:PORT,... of several controllers on "
                                               "one etcd store (the agent follows the leader); empty = serve "
                                               "standalone, without a controller")
    slots: int = setting(1, help="slots on this node: GPUs, or CPU slots where there is no GPU")
    backend: Literal["torch", "vllm", "sglang", "synthetic"] = setting(
        "torch", help="engine backend: torch (default), vllm (GPU only), sglang (an SGLang server this agent "
                      "launches, or attaches to with engine_options.url), synthetic (benchmarks only)")
    model: str = setting("tiny-llama", path="existing",
                         help="model: a built-in preset name (torch: tiny-llama, tiny-qwen2) or a local Hugging Face "
                              "directory (config.json + safetensors)")
    model_seed: int = setting(0, help="initialisation seed of a preset model (same seed = same weights)")
    stream_interval: int = setting(256, help="most tokens per streamed Generate chunk (a request can ask for "
                                             "fewer)")
    flush_interval_s: float = setting(0.2, help="longest a generated token waits before it is streamed: chunks "
                                                "are coalesced by time, so message rates follow time rather "
                                                "than engine steps; also the most tokens a replica crash costs "
                                                "(they are regenerated elsewhere); 0 = by stream_interval only")
    weight_sync_wait_s: float = setting(30.0, help="a Generate arriving while its serving replica receives "
                                                   "weights waits up to this long for them (and runs on them) "
                                                   "instead of being refused; 0 = refuse at once")
    max_waiting_requests: int = setting(1024, help="new requests beyond this many waiting per replica are "
                                                   "refused with RESOURCE_EXHAUSTED")
    gpu_memory_utilization: float = setting(0.5, help="memory fraction of HYBRID replicas, which share GPUs "
                                                      "with training (keep low, e.g. 0.3-0.5)")
    standalone_gpu_memory_utilization: float | None = setting(
        None, help="memory fraction of STANDALONE replicas (e.g. 0.6-0.8); null = gpu_memory_utilization")
    engine_options: dict[str, Any] = setting(default_factory=dict, help="extra backend-specific engine "
                                             "options (e.g. max_batch_size, device, dtype, tokens_per_second)")
    replicas: list[BootReplica] = setting(default_factory=list, help="replicas to start at boot")
    replica_processes: bool = setting(False, help="run each replica (its engine and its Generate streams) in a "
                                                  "process of its own, supervised by this agent, so a node's "
                                                  "token rate grows with its replicas instead of sharing one "
                                                  "event loop; balancers stream from the replica's process, "
                                                  "lifecycle calls still come here; a process that dies is a "
                                                  "FAILED replica")
    weight_transfer_timeout_s: float = setting(300.0, help="default timeout of a weight transfer when the "
                                                            "sync plan gives none")
    metrics_listen: str = setting("", help="HOST:PORT for a Prometheus /metrics endpoint; empty = off")
    weight_transfer: dict[str, Any] = setting(default_factory=dict, help="weight-transfer settings "
                                              "(bucket_size_bytes, setup_timeout_s, op_timeout_s, ring_size, "
                                              "topology, checksum_algorithm, gloo_interface, gloo_threads)")

    def validate(self) -> None:
        super().validate()
        check_addresses(self, "advertise_address", listen_keys=("metrics_listen",), list_keys=("controller_address",))
        if self.advertise_address and is_wildcard(parse_host_port(self.advertise_address)[0]):
            raise ConfigError("advertise_address", f"{self.advertise_address!r} is an address to listen on, not "
                                                   "to connect to: give the address other servers reach this "
                                                   "node at")
        if (self.controller_address and not self.advertise_address
                and is_wildcard(parse_host_port(self.listen)[0])):
            raise ConfigError("advertise_address", f"required when listen is a wildcard ({self.listen!r}) and a "
                                                   "controller is configured: the controller and the balancer "
                                                   "connect to the address this node registers")
        if self.slots < 1:
            raise ConfigError("slots", f"must be >= 1, got {self.slots}")
        if self.stream_interval < 1:
            raise ConfigError("stream_interval", f"must be >= 1, got {self.stream_interval}")
        if not self.flush_interval_s >= 0:
            raise ConfigError("flush_interval_s", f"must be >= 0, got {self.flush_interval_s}")
        if self.weight_sync_wait_s < 0:
            raise ConfigError("weight_sync_wait_s", f"must be >= 0, got {self.weight_sync_wait_s}")
        if self.max_waiting_requests < 1:
            raise ConfigError("max_waiting_requests", f"must be >= 1, got {self.max_waiting_requests}")
        for key in ("gpu_memory_utilization", "standalone_gpu_memory_utilization"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {value}")
        if self.weight_transfer_timeout_s <= 0:
            raise ConfigError("weight_transfer_timeout_s", "must be > 0")
        used = sum(r.slots for r in self.replicas)
        if used > self.slots:
            raise ConfigError("replicas", f"boot replicas need {used} slots but the node has slots: {self.slots}")
        ids = [r.replica_id for r in self.replicas if r.replica_id]
        if len(ids) != len(set(ids)):
            raise ConfigError("replicas", "replica ids must be unique")
        if self.backend != "vllm":   # vllm checks its options once it can import vllm
            # Surface bad engine options at load time, not when the first replica launches.
            from .engines import EngineError, create_engine  # noqa: PLC0415

            try:  # builds, never starts, an engine: options are checked, nothing is loaded
                create_engine(self.backend, **self.engine_options_for("STANDALONE", "check", 0))
            except EngineError as err:
                raise ConfigError("engine_options", str(err)) from None

    def memory_fraction(self, kind: str) -> float:
        """The reference's per-kind memory fraction (standalone falls back to hybrid's)."""
        if kind == "STANDALONE" and self.standalone_gpu_memory_utilization is not None:
            return self.standalone_gpu_memory_utilization
        return self.gpu_memory_utilization

    def engine_options_for(self, kind: str, replica_id: str, weight_version: int,
                           memory_fraction: float | None = None) -> dict[str, Any]:
        """Options for ``create_engine`` for one replica of this node."""
        options: dict[str, Any] = {"replica_id": replica_id, "node_id": self.node_id,
                                   "stream_interval": self.stream_interval, "flush_interval_s": self.flush_interval_s,
                                   "weight_version": weight_version}
        if self.backend == "torch":
            key = "model_path" if is_model_directory(self.model) else "preset"
            options.update({key: self.model, "seed": self.model_seed,
                            "memory_fraction": memory_fraction or self.memory_fraction(kind)})
        elif self.backend in ("vllm", "sglang"):
            options.update({"model_path": self.model, "seed": self.model_seed,
                            "memory_fraction": memory_fraction or self.memory_fraction(kind)})
        else:
            options.update({"seed": self.model_seed})
        options.update(self.engine_options)
        return options
