"""Configuration of ``rollmesh lb``."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from mesh_runtime.config import ConfigError, ServerConfig, check_addresses, setting
from mesh_runtime.errors import InvalidArgument
from mesh_runtime.net import AddressError, is_loopback, is_wildcard, parse_host_port
from mesh_runtime.validate import check_id

from .routing import POLICIES
from .workers import check_workers


@dataclasses.dataclass
class StaticReplica:
    """A replica to route to from the start, without a controller."""

    replica_id: str = setting(help="id of the replica on its agent")
    address: str = setting(help="HOST:PORT of the replica agent that hosts it")
    kind: Literal["STANDALONE", "HYBRID"] = setting("STANDALONE", help="STANDALONE or HYBRID")
    weight_version: int = setting(0, help="weight version the replica serves")

    def validate(self) -> None:
        if not self.replica_id:
            raise ConfigError("replica_id", "must not be empty")
        try:
            parse_host_port(self.address, allow_zero_port=False)
        except AddressError as err:
            raise ConfigError("address", str(err)) from None


@dataclasses.dataclass(frozen=True)
class OutlierDetectionConfig:
    """``outlier_detection``: take replicas that keep failing out of picks (Envoy's outlier detection)."""

    consecutive_failures: int = setting(3, help="attempts in a row that cannot reach a replica (UNAVAILABLE, a "
                                                "broken or stalled stream) before it is ejected from picks")
    base_ejection_s: float = setting(5.0, help="first ejection's length; the n-th in a row lasts n times this")
    max_ejection_s: float = setting(300.0, help="longest ejection")
    max_ejection_percent: float = setting(50.0, help="at most this share of the replicas is ejected at once "
                                                     "(at least one, never the last routable one)")

    def validate(self) -> None:
        if self.consecutive_failures < 1:
            raise ConfigError("consecutive_failures", f"must be >= 1, got {self.consecutive_failures}")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ConfigError("base_ejection_s", f"must be > 0 and <= max_ejection_s ({self.max_ejection_s}), "
                                                 f"got {self.base_ejection_s}")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError("max_ejection_percent", f"must be in [0, 100], got {self.max_ejection_percent}")


@dataclasses.dataclass(frozen=True)
class PrefixRoutingConfig:
    """``prefix_routing``: how ``routing_policy: prefix_cost`` and ``prefix_aware`` weigh cache affinity against
    load."""

    block_tokens: int = setting(64, help="prompt tokens per indexed block for replicas whose engines publish no "
                                         "prefix events (with kv_events, a replica is indexed at its engine's "
                                         "block size); a prompt shorter than one block is routed by load alone")
    max_prefix_tokens: int = setting(0, help="leading tokens of a prompt indexed and matched; 0 = the whole "
                                             "prompt (the index's memory is bounded by cache_tokens either way)")
    cache_tokens: int = setting(400_000, help="tokens of prompts remembered per replica, least recently used "
                                              "first out: set it to the replicas' KV cache size (the engine "
                                              "evicts beyond it)")
    max_load_gap: int = setting(4, help="routing_policy prefix_aware: a request goes to the replica holding most "
                                        "of its prefix unless that replica has more than max(max_load_gap, "
                                        "max_load_ratio x least) in-flight requests above the least loaded one; "
                                        "then it spills to the least loaded (so at light load a shared prompt "
                                        "still spreads, and at heavy load a GRPO group stays together)")
    max_load_ratio: float = setting(0.5, help="see max_load_gap")
    kv_events: bool = setting(False, help="also follow the replicas' own prefix-cache events (the agents' "
                                          "WatchPrefixCache, where an engine publishes them): a replica's entries "
                                          "then leave when its engine evicts them, and all go when new weights "
                                          "empty its cache. Each replica is then indexed at the block size its "
                                          "engine uses, whatever block_tokens says")
    prefill_weight: float = setting(32.0, help="routing_policy prefix_cost: the price of prefilling a prompt "
                                               "token, in tokens of context held (a request costs a replica the "
                                               "context it already holds plus prefill_weight x the prompt tokens "
                                               "not cached there)")
    max_load_excess: float = setting(0.25, help="routing_policy prefix_cost: no replica takes a request that would "
                                                "make it hold more than (1 + max_load_excess) x the fleet's mean "
                                                "tokens while another stays within it (bounded-load affinity)")
    prefill_load: float = setting(2.0, help="routing_policy prefix_cost: a request in flight loads its replica by "
                                            "its context plus prefill_load x the prompt tokens it found uncached "
                                            "there, so a replica prefilling many new prompts counts as busier "
                                            "than one holding the same context cached")
    warmup_s: float = setting(0.0, help="routing_policy prefix_aware: a replica that joined the table less than "
                                        "this ago counts as loaded as the others' mean, less in proportion to "
                                        "its age, so a new empty replica is filled gradually instead of taking "
                                        "every spill at once; "
                                        "0 = off (the default: replicas are added, scaled out or activated "
                                        "because capacity is short, and should take load at once)")

    def validate(self) -> None:
        for key in ("block_tokens", "cache_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.max_prefix_tokens < 0:
            raise ConfigError("max_prefix_tokens", f"must be >= 0 (0: the whole prompt), got {self.max_prefix_tokens}")
        if self.cache_tokens < self.block_tokens:
            raise ConfigError("cache_tokens", f"must hold a block of block_tokens ({self.block_tokens}), got "
                                              f"{self.cache_tokens}")
        for key in ("max_load_gap", "max_load_ratio", "warmup_s", "prefill_weight", "max_load_excess",
                    "prefill_load"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")


@dataclasses.dataclass(frozen=True)
class ProgramAdmissionConfig:
    """``program_admission``: a session's requests as one program, admitted to a replica while its KV has room
    (loadbalancer/programs.py)."""

    enabled: bool = setting(False, help="route a session's requests as one program: its turns go to the replica "
                                        "it is active on, and a new (or parked) program waits at the balancer "
                                        "until a replica's active programs leave room for its context in that "
                                        "replica's KV budget (oldest program first); when a replica's programs "
                                        "outgrow it, the youngest waiting on a tool there are parked (their KV "
                                        "hold released). Requests without a session_id are not affected")
    kv_tokens: int = setting(0, help="every replica's KV capacity in tokens; 0 = each replica's own, from its "
                                     "agent's load reports (max_total_tokens); a replica whose capacity is "
                                     "not known admits every program")
    kv_fraction: float = setting(1.0, help="share of a replica's KV capacity its active programs' contexts (each "
                                           "the latest turn's prompt plus its expected completion) may fill")
    reserve_final: float = setting(0.0, help="admit by whole-program cost: every program, the one asking and "
                                             "those active on a replica, counts for at least this share of the "
                                             "mean final context of the programs that ended (a running mean), so "
                                             "a replica takes no more young programs than it holds once grown; "
                                             "0 = their contexts so far. Parking counts the contexts themselves")
    idle_s: float = setting(300.0, help="a program with no request for this long ends (a trajectory that never "
                                        "sent CloseSession nor marked its last turn with expected_pause 0)")
    report_interval_s: float = setting(5.0, help="how often the balancer reads the agents' load reports for "
                                                 "their replicas' KV capacity (kv_tokens 0)")

    def validate(self) -> None:
        if self.kv_tokens < 0:
            raise ConfigError("kv_tokens", f"must be >= 0 (0: from the load reports), got {self.kv_tokens}")
        if not 0 < self.kv_fraction <= 4:
            raise ConfigError("kv_fraction", f"must be in (0, 4], got {self.kv_fraction}")
        if not 0 <= self.reserve_final <= 4:
            raise ConfigError("reserve_final", f"must be in [0, 4], got {self.reserve_final}")
        for key in ("idle_s", "report_interval_s"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be > 0 and finite, got {getattr(self, key)}")


@dataclasses.dataclass
class LoadBalancerConfig(ServerConfig):
    """Settings of the load balancer (``--print-default-config`` lists them)."""

    listen: str = setting("127.0.0.1:50052", help="HOST:PORT to serve gRPC on; port 0 picks a free port")
    controller_address: str = setting("", help="HOST:PORT of the controller to register this balancer with (it "
                                               "then keeps this balancer's routing table in line and lists it "
                                               "to clients), or HOST:PORT,HOST:PORT,... of several controllers "
                                               "on one etcd store (the balancer follows the leader); empty = "
                                               "do not register (a controller may still name this balancer "
                                               "in its load_balancer_address)")
    advertise_address: str = setting("", help="HOST:PORT the controller and clients use to reach this balancer; "
                                              "empty = the address it listens on")
    balancer_id: str = setting("", help="id of this balancer in the controller's registry, the same across its "
                                        "restarts; empty = the name its certificate gives it (mutual TLS), "
                                        "else its advertised address")
    replicas: list[StaticReplica] = setting(default_factory=list, help="replicas to route to from the start "
                                            "(the controller adds and removes replicas at run time)")
    routing_policy: str = setting(
        "prefix_cost", help="prefix_cost: the replica where the request costs least in tokens (the tokens it "
                            "holds plus the prompt it must prefill; a session's last replica counts as holding "
                            "its last prompt), within a bound on load in tokens (prefix_routing); prefix_aware: "
                            "the replica that was sent most of the prompt's leading tokens (its prefix cache "
                            "holds them), within a load gap in requests (prefix_routing), else the least loaded; "
                            "least_loaded: the replica with the fewest in-flight requests (round robin among "
                            "equals); a plug-in's name (loadbalancer.routing.register). Under prefix_aware and "
                            "least_loaded sessions are pinned (sticky_max_load_gap); under prefix_cost a session "
                            "keeps its replica by cost")
    prefix_routing: PrefixRoutingConfig = setting(default_factory=PrefixRoutingConfig,
                                                  help="cache affinity against load, for routing_policy: "
                                                       "prefix_cost and prefix_aware")
    program_admission: ProgramAdmissionConfig = setting(default_factory=ProgramAdmissionConfig,
                                                        help="sessions as programs admitted by KV room")
    pin_sessions: bool | None = setting(None, help="whether a session sticks to its replica (within "
                                                   "sticky_max_load_gap) before the policy chooses; null = the "
                                                   "policy's own way (prefix_cost pins none: a session keeps "
                                                   "its replica by cost; the others pin)")
    sticky_max_load_gap: int = setting(4, help="a sticky session leaves its replica when that replica has more "
                                               "than this many in-flight requests above the least loaded one")
    max_sticky_sessions: int = setting(100_000, help="sticky-session pins kept (least recently used dropped)")
    sticky_session_idle_s: float | None = setting(3600.0, help="a sticky-session pin unused this long is dropped "
                                                               "(a trajectory that never sent CloseSession); "
                                                               "null = kept until evicted by count")
    max_kv_hold_s: float = setting(30.0, help="a session's request asks its replica to hold the session's KV "
                                              "after it ends, for the session's next request (an agent's tool "
                                              "call in between): for the request's expected_pause, or when it "
                                              "gives none for the kv_hold_quantile of the pauses seen between "
                                              "sessions' requests, at most this long; 0 = never hold. Held KV "
                                              "is evicted after KV nobody holds and given up under pressure")
    kv_hold_quantile: float = setting(0.9, help="see max_kv_hold_s: the share of returning sessions whose pause "
                                                "the estimated hold covers")
    max_version_lag: int | None = setting(None, help="route only to replicas at most this many weight versions "
                                                     "behind the newest known; null = no limit")
    retry_budget: int = setting(16, help="extra attempts allowed per request after the first (aborts and "
                                         "failures both count); a request can override it")
    partial_rollout: bool = setting(True, help="default for requests that do not say: resume an aborted "
                                               "request with its generated prefix (true) or regenerate (false)")
    stall_timeout_s: float = setting(120.0, help="an attempt that receives nothing for this long (a frozen or "
                                                 "silent replica) is cut and resumed elsewhere with its tokens "
                                                 "so far; longer than any normal gap (queueing, a paused "
                                                 "engine during a weight sync)")
    outlier_detection: OutlierDetectionConfig = setting(default_factory=OutlierDetectionConfig,
                                                        help="ejection of replicas that keep failing")
    no_replica_wait_s: float = setting(60.0, help="how long a request waits for an eligible replica before it "
                                                  "fails with UNAVAILABLE")
    retry_initial_backoff_s: float = setting(0.05, help="first backoff before retrying after an UNAVAILABLE "
                                                        "replica (doubles each time, jittered)")
    retry_max_backoff_s: float = setting(2.0, help="largest backoff between retries")
    agent_streams: bool = setting(True, help="send untraced attempts to each replica agent on one GenerateMany "
                                             "stream (no call per request; chunks of many requests batched "
                                             "into one message); false = a Generate call per attempt. Traced "
                                             "attempts and agents without GenerateMany use Generate calls")
    upstream_call_timeout_s: float = setting(10.0, help="deadline of control calls to replica agents (abort)")
    abort_grace_s: float = setting(1.0, help="after a removal with abort, how long an attempt may take to end "
                                             "with its replica's abort reply before the balancer cuts it (a "
                                             "frozen agent never replies)")
    completed_cache_size: int = setting(10_000, help="completed requests remembered, so a repeated request_id "
                                                     "is answered from the record instead of generated twice")
    completed_cache_bytes: int = setting(64 * 1024 * 1024, help="bound of the completed-request records in bytes "
                                                                "(their tokens); the oldest go first")
    completed_cache_ttl_s: float = setting(600.0, help="completed-request records older than this are dropped; a "
                                                       "repeat after that is generated again")
    metrics_listen: str = setting("", help="HOST:PORT for a Prometheus /metrics endpoint; empty = off")
    http_listen: str = setting("", help="HOST:PORT to serve the OpenAI-compatible HTTP API on (flag --http-listen): "
                                        "/v1/models, /v1/completions, /v1/chat/completions, DELETE "
                                        "/v1/sessions/ID; empty = off. Needs model; HTTPS with client "
                                        "certificates when tls is set; off loopback without tls it needs "
                                        "http_api_token")
    model: str = setting("", path="existing", help="the model the replicas serve, for the HTTP API's tokenizer "
                                                   "and chat template: its Hugging Face directory or a preset "
                                                   "name (tiny-llama)")
    served_model_name: str = setting("", help="the model's name in the HTTP API (/v1/models, the requests' "
                                              "model field); empty = the preset name or the directory's name")
    http_api_token: str = setting("", secret=True, help="bearer token every HTTP API call must present "
                                                        "(Authorization: Bearer TOKEN); empty = none (then "
                                                        "only allowed on loopback or with tls)")
    http_plaintext: bool = setting(False, help="serve the HTTP API as plain HTTP even though tls is set (gRPC "
                                               "stays mutual TLS), for clients without certificates: on "
                                               "loopback, or elsewhere with http_api_token")
    http_max_in_flight: int = setting(4096, help="generations the HTTP API runs at once; more are refused with "
                                                 "429 and Retry-After")
    workers: int = setting(1, help="balancer processes on this host (flag --workers): each registers with the "
                                   "controller as <balancer_id>-w<i> on port + i of listen (and of "
                                   "advertise_address, metrics_listen, health_listen), and clients spread "
                                   "requests over them; needs controller_address")

    def validate(self) -> None:
        super().validate()
        ids = [r.replica_id for r in self.replicas]
        if len(ids) != len(set(ids)):
            raise ConfigError("replicas", "replica ids must be unique")
        positive = ("sticky_max_load_gap", "max_sticky_sessions", "completed_cache_size", "completed_cache_bytes",
                    "completed_cache_ttl_s")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.routing_policy not in POLICIES:
            raise ConfigError("routing_policy", f"unknown policy {self.routing_policy[:64]!r}; known: "
                                                f"{', '.join(sorted(POLICIES))}")
        if self.max_version_lag is not None and self.max_version_lag < 0:
            raise ConfigError("max_version_lag", f"must be >= 0 or null, got {self.max_version_lag}")
        if self.sticky_session_idle_s is not None and not self.sticky_session_idle_s > 0:
            raise ConfigError("sticky_session_idle_s", f"must be > 0 or null, got {self.sticky_session_idle_s}")
        if self.retry_budget < 0:
            raise ConfigError("retry_budget", f"must be >= 0, got {self.retry_budget}")
        if not 0 <= self.max_kv_hold_s < math.inf:
            raise ConfigError("max_kv_hold_s", f"must be >= 0 and finite, got {self.max_kv_hold_s}")
        if not 0 < self.kv_hold_quantile <= 1:
            raise ConfigError("kv_hold_quantile", f"must be in (0, 1], got {self.kv_hold_quantile}")
        for key in ("no_replica_wait_s", "retry_initial_backoff_s", "retry_max_backoff_s", "upstream_call_timeout_s",
                    "stall_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if self.retry_max_backoff_s < self.retry_initial_backoff_s:
            raise ConfigError("retry_max_backoff_s", f"must be >= retry_initial_backoff_s "
                                                     f"({self.retry_initial_backoff_s}), got {self.retry_max_backoff_s}")
        if self.abort_grace_s < 0:
            raise ConfigError("abort_grace_s", f"must be >= 0, got {self.abort_grace_s}")
        check_addresses(self, "advertise_address", listen_keys=("metrics_listen", "http_listen"),
                        list_keys=("controller_address",))
        self._check_http()
        check_workers(self)
        if self.advertise_address and is_wildcard(parse_host_port(self.advertise_address)[0]):
            raise ConfigError("advertise_address", f"{self.advertise_address[:64]!r} is an address to listen on, "
                                                   "not to connect to: give the address others reach this "
                                                   "balancer at")
        if self.controller_address and not self.advertise_address and is_wildcard(parse_host_port(self.listen)[0]):
            raise ConfigError("advertise_address", f"required when listen is a wildcard ({self.listen!r}) and a "
                                                   "controller is configured: the controller and the clients "
                                                   "connect to the address this balancer registers")
        if self.balancer_id:
            try:
                check_id(self.balancer_id, "balancer_id")
            except InvalidArgument as err:
                raise ConfigError("balancer_id", err.message) from None

    def _check_http(self) -> None:
        if self.http_max_in_flight < 1:
            raise ConfigError("http_max_in_flight", f"must be >= 1, got {self.http_max_in_flight}")
        if not self.http_listen:
            return
        if not self.model:
            raise ConfigError("model", "required with http_listen: the HTTP API tokenizes with the served model's "
                                       "tokenizer (give its directory or preset name)")
        plaintext = self.tls is None or self.http_plaintext
        if plaintext and not self.http_api_token and not is_loopback(parse_host_port(self.http_listen)[0]):
            raise ConfigError("http_api_token", f"http_listen {self.http_listen[:64]} is not a loopback address: "
                                                "give tls (HTTPS with client certificates, http_plaintext off) or "
                                                "an http_api_token")
