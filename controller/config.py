"""Configuration of ``rollmesh controller``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml

from mesh_runtime.config import ConfigError, ServerConfig, check_addresses, setting

from .core.config import SchedulingConfig

if TYPE_CHECKING:
    from .scaling.autoscaler import AutoscalerConfig


@dataclasses.dataclass
class StoreTlsConfig:
    """TLS from the controller to its etcd store (etcd's --trusted-ca-file / --client-cert-auth)."""

    ca: str = setting(help="PEM CA bundle that the etcd members' certificates must chain to", path=True)
    cert: str = setting("", help="PEM client certificate (etcd with --client-cert-auth); with key", path=True)
    key: str = setting("", help="PEM private key of cert", path=True)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("store_tls", "give cert and key together (or neither)")
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if name == "ca" and not path:
                raise ConfigError("store_tls.ca", "is required")
            if path and not Path(path).is_file():
                raise ConfigError(f"store_tls.{name}", f"no such file: {path[:200]}")


@dataclasses.dataclass
class ControllerConfig(ServerConfig):
    """Settings of the controller (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50051", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    load_balancer_address: str = setting("", help="HOST:PORT of the load balancer whose routing table "
                                                  "this controller maintains, or HOST:PORT,HOST:PORT,... of "
                                                  "several (each gets every routing change); empty = none "
                                                  "configured")
    trainer_address: str = setting("", help="HOST:PORT of the trainer agent on rank 0, the source of weight "
                                            "broadcasts; empty = none (weight syncs then fail)")
    peer_timeout_s: float = setting(2.0, help="deadline in seconds for each call the controller makes "
                                              "to probe a peer in GetStatus")
    state_dir: str = setting("", help="directory of the controller's durable state (SQLite); empty = keep "
                                      "nothing across restarts", path=True)
    store: str = setting("", help="where the durable state lives, overriding state_dir: sqlite:///PATH (one file) "
                                  "or etcd://HOST:PORT[,HOST:PORT...]/PREFIX (an etcd cluster, through its v3 JSON "
                                  "gateway); empty = SQLite in state_dir")
    store_lease_ttl_s: int = setting(5, help="seconds of the etcd lease by which one controller owns an etcd store: "
                                             "a controller that waits for the store takes over this long after "
                                             "its owner dies (at once after a clean shutdown); renewed every third")
    advertise_address: str = setting("", help="HOST:PORT other servers reach this controller at, named to callers "
                                              "by standbys when it leads an etcd store; empty = the address it "
                                              "binds (listen with its real port)")
    standby_refresh_s: float = setting(1.0, help="how often a standby controller (one waiting for an etcd store "
                                                 "another leads) reloads its read-only copy of the state and "
                                                 "tries to take the store over")
    store_tls: StoreTlsConfig | None = setting(None, help="TLS to the etcd store: {ca, cert, key} PEM paths; "
                                                          "required when an etcd member is not on loopback "
                                                          "(unless insecure)")
    reconcile_interval_s: float = setting(2.0, help="how often the controller makes the balancer's routing table "
                                                    "equal to the registry again (a restarted balancer, a stray "
                                                    "RemoveReplicas or AddReplicas heal within one interval)")
    lease_ttl_s: float = setting(10.0, help="a node whose agent sends no load report for this long loses its "
                                            "lease: its replicas go FAILED and leave routing")
    load_report_interval_s: float = setting(1.0, help="how often agents push load reports (sent to them); the "
                                                      "shortest interval: it grows with the fleet, see "
                                                      "max_load_reports_per_s")
    max_load_reports_per_s: float = setting(1000.0, help="load reports per second the whole fleet may send: past "
                                                         "that many nodes the interval the agents are told grows "
                                                         "to nodes / this, and lease_ttl_s with it (same ratio)")
    max_registrations_per_s: float = setting(500.0, help="registrations admitted per second (a burst of that many "
                                                         "at once); beyond, RegisterNode answers RESOURCE_EXHAUSTED "
                                                         "with a RetryInfo spreading the retries over time")
    event_retention: int = setting(10_000, help="lifecycle events kept for WatchEvents replay (at least; see "
                                                "event_retention_s)")
    event_retention_s: float = setting(600.0, help="events younger than this are kept past event_retention, so "
                                                   "a registration storm does not evict what a watcher needs "
                                                   "(up to event_retention_max)")
    event_retention_max: int = setting(200_000, help="the most events kept whatever their age (bounds memory: "
                                                     "about 1 KB each)")
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
    scale_out_timeout: float = setting(1800.0, help="seconds a scale-out may take when the request gives no "
                                                    "timeout (the reference's --scale-out-timeout)")
    scale_out_partial_success_policy: Literal["rollback_all", "keep_partial"] = setting(
        "rollback_all", help="what a scale-out keeps when some new replicas fail: rollback_all releases every "
                             "replica it created, keep_partial keeps the ones that came up")
    scale_out_weight_source: Literal["auto", "trainer", "replica"] = setting(
        "auto", help="where replicas a scale-out adds get the current weight version before they take traffic: "
                     "trainer (the trainer only), replica (a healthy ACTIVE replica already at that version, on "
                     "the new replicas' node first) or auto (such a replica when one prepares, else the trainer, "
                     "so joins leave the trainer to the training steps' syncs)")
    peer_copy_sources: int = setting(4, help="most peers that send full copies at once (a scale-out's replicas, "
                                              "ones behind the delta's base): one copy enters each node, from a "
                                              "replica at the version on that node when there is one, else "
                                              "from peers elsewhere, each sending a chain that its members "
                                              "relay; beyond this many sources, nodes join the shortest chain. "
                                              "Each source holds one more copy of the model while it sends. "
                                              "1 = one chain from one peer")
    scale_in_drain_timeout: float = setting(30.0, help="seconds a scale-in waits for in-flight requests on the "
                                                       "replicas it removes; then they are aborted and the load "
                                                       "balancer resumes them elsewhere")
    scale_in_shutdown_timeout: float = setting(20.0, help="seconds a removed replica may take to stop cleanly "
                                                          "before it is stopped by force")
    rollout_num_gpus_per_engine: int = setting(1, help="slots each replica launched by a native scale-out uses")
    max_replicas_per_model: int = setting(256, help="largest scale target accepted (num_replicas above it is "
                                                    "INVALID_ARGUMENT)")
    autoscaler_config: str = setting("", help="YAML file of the autoscaler (the reference's fields); empty = "
                                              "no autoscaler (the reference's --autoscaler-config)", path=True)
    scale_api_token: str = setting("", secret=True, help="credential that mutating scale RPCs must present as "
                                                         "metadata 'authorization: Bearer TOKEN'; empty = no "
                                                         "credential required")
    scale_api_read_tokens: list[str] = setting(default_factory=list, secret=True,
                                               help="credentials that are known but may not change the mesh "
                                                    "(mutating scale RPCs answer PERMISSION_DENIED)")
    async_training: SchedulingConfig = setting(default_factory=SchedulingConfig,
                                               help="dynamic resource scheduling, keys as in the reference")

    def validate(self) -> None:
        super().validate()
        check_addresses(self, "trainer_address", "advertise_address", listen_keys=("metrics_listen",),
                        list_keys=("load_balancer_address",))
        positive = {"peer_timeout_s": self.peer_timeout_s, "lease_ttl_s": self.lease_ttl_s,
                    "reconcile_interval_s": self.reconcile_interval_s,
                    "load_report_interval_s": self.load_report_interval_s,
                    "max_load_reports_per_s": self.max_load_reports_per_s,
                    "max_registrations_per_s": self.max_registrations_per_s,
                    "event_retention_s": self.event_retention_s, "event_retention_max": self.event_retention_max,
                    "event_retention": self.event_retention, "watcher_queue_size": self.watcher_queue_size,
                    "concurrent_samples_per_replica": self.concurrent_samples_per_replica,
                    "max_required_samples": self.max_required_samples}
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(key, f"must be > 0, got {value}")
        if self.event_retention_max < self.event_retention:
            raise ConfigError("event_retention_max", f"must be >= event_retention ({self.event_retention})")
        if self.load_report_interval_s >= self.lease_ttl_s:
            raise ConfigError("load_report_interval_s", f"must be shorter than lease_ttl_s ({self.lease_ttl_s})")
        for key in ("weight_bucket_size_bytes", "hybrid_gpus", "standalone_gpus"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        for key in ("scale_out_timeout", "scale_in_drain_timeout", "scale_in_shutdown_timeout",
                    "rollout_num_gpus_per_engine", "max_replicas_per_model", "peer_copy_sources"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if self.store:
            from mesh_runtime.net import is_loopback  # noqa: PLC0415

            from .store_backends import parse_store_url  # noqa: PLC0415

            kind, where = parse_store_url(self.store)
            remote = [f"{h}:{p}" for h, p in where[0] if not is_loopback(h)] if kind == "etcd" else []
            if remote and self.store_tls is None and not self.insecure:
                raise ConfigError("store_tls", f"etcd member {remote[0][:64]} is not on loopback and no store_tls "
                                               "is configured: give store_tls {ca, cert, key}, or insecure to "
                                               "send the mesh's state in plaintext")
        if self.store_tls is not None:
            self.store_tls.validate()
        if not 0.05 <= self.standby_refresh_s <= 60:
            raise ConfigError("standby_refresh_s", f"must be 0.05 to 60 seconds, got {self.standby_refresh_s}")
        if not 1 <= self.store_lease_ttl_s <= 600:
            raise ConfigError("store_lease_ttl_s", f"must be 1 to 600 seconds, got {self.store_lease_ttl_s}")
        if any(not t for t in self.scale_api_read_tokens):
            raise ConfigError("scale_api_read_tokens", "tokens must not be empty")
        if self.scale_api_token and self.scale_api_token in self.scale_api_read_tokens:
            raise ConfigError("scale_api_read_tokens", "must not contain scale_api_token")
        self.load_autoscaler()
        from .core.errors import CoreError  # noqa: PLC0415
        from .core.policies import resolve_policy  # noqa: PLC0415

        try:
            resolve_policy(self.async_training.dynamic_schedule_policy)
        except CoreError as err:
            raise ConfigError("async_training.dynamic_schedule_policy", str(err)) from None

    def load_autoscaler(self) -> AutoscalerConfig | None:
        """The parsed autoscaler config, or None without ``autoscaler_config``; ConfigError when invalid."""
        from .scaling.autoscaler import AutoscalerConfig  # noqa: PLC0415

        if not self.autoscaler_config:
            return None
        try:
            data = yaml.safe_load(Path(self.autoscaler_config).read_text())
        except OSError as err:
            raise ConfigError("autoscaler_config", f"cannot read {self.autoscaler_config}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise ConfigError("autoscaler_config", f"{self.autoscaler_config} is not valid YAML: {err}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError("autoscaler_config", f"{self.autoscaler_config} must hold a mapping")
        try:
            return AutoscalerConfig.from_dict(data or {})
        except (TypeError, ValueError) as err:
            raise ConfigError("autoscaler_config", f"{self.autoscaler_config}: {err}") from None
