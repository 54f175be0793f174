"""Configuration of ``rollmesh controller``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from mesh_runtime.config import ConfigError, ServerConfig, check_addresses, setting

from .core.config import SchedulingConfig


@dataclasses.dataclass
class ControllerConfig(ServerConfig):
    """Settings of the controller (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50051", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    load_balancer_address: str = setting("", help="HOST:PORT of the load balancer whose routing table "
                                                  "this controller maintains; empty = none configured")
    trainer_address: str = setting("", help="HOST:PORT of the trainer agent on rank 0, the source of weight "
                                            "broadcasts; empty = none (weight syncs then fail)")
    peer_timeout_s: float = setting(2.0, help="deadline in seconds for each call the controller makes "
                                              "to probe a peer in GetStatus")
    state_dir: str = setting("", help="directory of the controller's durable state (SQLite); empty = keep "
                                      "nothing across restarts")
    lease_ttl_s: float = setting(10.0, help="a node whose agent sends no load report for this long loses its "
                                            "lease: its replicas go FAILED and leave routing")
    load_report_interval_s: float = setting(1.0, help="how often agents push load reports (sent to them)")
    event_retention: int = setting(10_000, help="lifecycle events kept for WatchEvents replay")
    watcher_queue_size: int = setting(1_000, help="events buffered per WatchEvents stream before it falls "
                                                  "back to replay (and a GAP event if it fell too far behind)")
    weight_sync_backend: Literal["gloo", "nccl"] = setting("gloo", help="process-group backend of weight "
                                                                        "broadcasts: gloo (CPU) or nccl (GPU)")
    weight_bucket_size_bytes: int = setting(0, help="bytes per broadcast bucket; 0 = the trainer's default")
    hybrid_gpus: int = setting(0, help="a in the reference's section 4: trainer GPUs that can do rollout "
                                       "(trainer.nnodes x trainer.n_gpus_per_node)")
    standalone_gpus: int = setting(0, help="b in section 4: dedicated rollout GPUs "
                                           "(rollout.nnodes x rollout.n_gpus_per_node)")
    concurrent_samples_per_replica: int = setting(16, help="s in section 4: rollout concurrency per replica")
    max_required_samples: int = setting(1024, help="maxReq in section 4: the rollouter's concurrency cap")
    metrics_listen: str = setting("", help="HOST:PORT for a Prometheus /metrics endpoint; empty = off")
    async_training: SchedulingConfig = setting(default_factory=SchedulingConfig,
                                               help="dynamic resource scheduling, keys as in the reference")

    def validate(self) -> None:
        super().validate()
        check_addresses(self, "load_balancer_address", "trainer_address", listen_keys=("metrics_listen",))
        positive = {"peer_timeout_s": self.peer_timeout_s, "lease_ttl_s": self.lease_ttl_s,
                    "load_report_interval_s": self.load_report_interval_s,
                    "event_retention": self.event_retention, "watcher_queue_size": self.watcher_queue_size,
                    "concurrent_samples_per_replica": self.concurrent_samples_per_replica,
                    "max_required_samples": self.max_required_samples}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(key, f"must be > 0, got {value}")
        if self.load_report_interval_s >= self.lease_ttl_s:
            raise ConfigError("load_report_interval_s", f"must be shorter than lease_ttl_s ({self.lease_ttl_s})")
        for key in ("weight_bucket_size_bytes", "hybrid_gpus", "standalone_gpus"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        from .core.errors import CoreError  # noqa: PLC0415
        from .core.policies import resolve_policy  # noqa: PLC0415

        try:
            resolve_policy(self.async_training.dynamic_schedule_policy)
        except CoreError as err:
            raise ConfigError("async_training.dynamic_schedule_policy", str(err)) from None
