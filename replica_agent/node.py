"""One inference node: its replicas, its controller lease and its metrics endpoint.

:class:`Node` is what the replica agent's servicer delegates to. At start it
launches the configured boot replicas, opens the Prometheus endpoint if one
is configured, and (with a controller address) keeps the node registered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.core import GaugeMetricFamily

from mesh_runtime import __version__
from mesh_runtime.channels import ChannelPool
from mesh_runtime.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from mesh_runtime.metrics import ServerMetrics
from mesh_runtime.reasons import Reason
from mesh_runtime.server import MeshServer
from mesh_runtime.status import node_name
from rollmesh.common.v1 import load_pb2, weights_pb2
from rollmesh.controller.v1 import registry_pb2
from rollmesh.replica.v1 import replica_pb2

from . import convert
from .config import ReplicaAgentConfig
from .engines import Engine, create_engine
from .process_metrics import ChildMetrics
from .processes import ReplicaProcess, ReplicaProcesses
from .replicas import Replica, ReplicaManager

if TYPE_CHECKING:
    from .checkpoint_load import CheckpointLoads
    from .group_weights import GroupWeights
    from .controller_link import ControllerLink
    from .weights import PreparedSource, ReceiveResult, SendResult, WeightGroups

log = logging.getLogger(__name__)

_IDEMPOTENCY_KEYS = 1024
REPLICA_GAUGES = ("rollmesh_replica_running_requests", "rollmesh_replica_waiting_requests",
                  "rollmesh_replica_kv_cache_usage_ratio", "rollmesh_replica_weight_version", "rollmesh_replica_state")
"""The gauges :meth:`Node.metric_families` computes from load reports."""


class Node:
    """The replica agent's domain object for this node."""

    def __init__(self, config: ReplicaAgentConfig, tracer_provider: TracerProvider | None) -> None:
        self.config = config
        self.node_id = node_name(config.node_id)
        self.tracer_provider = tracer_provider
        self.address = config.advertise_address or config.listen
        self.replicas = ReplicaManager(node_id=self.node_id, slots_total=config.slots,
                                       engine_factory=self._create_engine,
                                       default_memory_fraction=config.memory_fraction,
                                       max_waiting_requests=config.max_waiting_requests,
                                       sync_wait_s=config.weight_sync_wait_s)
        self.processes: ReplicaProcesses | None = None
        """The replica processes when ``replica_processes`` is on (then ``replicas`` stays empty)."""
        if config.replica_processes:
            self.processes = ReplicaProcesses(config, node_id=self.node_id, address=lambda: self.address,
                                              pool=ChannelPool(tls=config.tls, tracer_provider=tracer_provider))
        self._launch_keys: OrderedDict[str, tuple[tuple, str]] = OrderedDict()
        self._ids = itertools.count()
        self.link: ControllerLink | None = None
        self.server_metrics = ServerMetrics()
        self.server_metrics.on_scrape(self.metric_families)
        if self.processes is None:
            self.timing: _Timing | None = _Timing(self.server_metrics)
        else:   # the replicas count in their processes; their counters join this node's endpoint at scrape
            self.timing = None
            children, processes = ChildMetrics(skip=REPLICA_GAUGES), self.processes
            self.server_metrics.before_scrape(lambda: children.gather(processes.metrics_addresses()))
            self.server_metrics.on_scrape(children.families)
        self._groups: WeightGroups | None = None
        self._checkpoint_loads: CheckpointLoads | None = None
        self._trainer_groups: GroupWeights | None = None

    def _create_engine(self, replica_id: str, kind: str, memory_fraction: float, weight_version: int,
                       engine_url: str = "") -> Engine:
        options = self.config.engine_options_for(kind, replica_id, weight_version, memory_fraction)
        options["node_id"] = self.node_id
        if engine_url:
            if self.config.backend != "sglang":
                raise FailedPrecondition(f"this agent runs the {self.config.backend} backend; only sglang agents "
                                         f"attach to running engine servers such as {engine_url[:80]}",
                                         reason=Reason.CANNOT_ATTACH)
            options["url"] = engine_url
        return create_engine(self.config.backend, **options)

    def _next_replica_id(self) -> str:
        while True:
            candidate = f"{self.node_id}-r{next(self._ids)}"
            if candidate not in {r.replica_id for r in self.serving().list()}:
                return candidate

    async def start(self, server: MeshServer) -> None:
        """Boot replicas, metrics endpoint and controller link (called once the server is bound)."""
        if not self.config.advertise_address:
            self.address = server.address
        server.add_cleanup(self.replicas.close)
        server.add_cleanup(self.close_weight_groups)
        if self.processes is not None:
            server.add_cleanup(self.processes.close)
        for spec in self.config.replicas:
            await self.serving().launch(replica_id=spec.replica_id or self._next_replica_id(), kind=spec.kind,
                                        slots=spec.slots, start_asleep=spec.asleep_at_boot, initial=True)
        if self.config.controller_address:
            from .controller_link import ControllerLink  # noqa: PLC0415, F811 - imported here at run time

            pool = ChannelPool(tls=self.config.tls, tracer_provider=self.tracer_provider)
            server.add_cleanup(pool.close)
            address = self.config.controller_address
            link = ControllerLink(channel=lambda: pool.get(address), registration=self.registration,
                                  reports=lambda: [self.load_report(r) for r in self.serving().list()],
                                  on_rejected=self._stop_rejected)
            self.link = link
            server.spawn(link.run(), name="controller-link")

    def serving(self) -> ReplicaManager | ReplicaProcesses:
        """Whoever holds this node's replicas: the replica processes, else the in-process manager."""
        return self.processes if self.processes is not None else self.replicas

    async def launch_once(self, *, request_id: str, replica_id: str, **params: Any) -> Replica | ReplicaProcess:
        """Launch a replica; a repeated ``request_id`` returns the first launch's replica."""
        key = (replica_id, tuple(sorted(params.items())))
        if request_id and request_id in self._launch_keys:
            seen_key, seen_id = self._launch_keys[request_id]
            if seen_key != key:
                raise AlreadyExists(f"request_id {request_id!r} was already used for a different launch",
                                    reason=Reason.IDEMPOTENCY_KEY_REUSED)
            return self.serving().get(seen_id)
        replica = await self.serving().launch(replica_id=replica_id or self._next_replica_id(), **params)
        if request_id:
            self._launch_keys[request_id] = (key, replica.replica_id)
            while len(self._launch_keys) > _IDEMPOTENCY_KEYS:
                self._launch_keys.popitem(last=False)
        return replica

    def _weight_groups(self) -> WeightGroups:
        if self._groups is None:
            from .weights import WeightGroups  # noqa: PLC0415 - imports torch, only when weights move
            from weight_transfer import WeightTransferConfig  # noqa: PLC0415

            self._groups = WeightGroups(WeightTransferConfig(**self.config.weight_transfer))
        return self._groups

    async def receive_weights(self, replica_ids: list[str], plan_msg: weights_pb2.WeightSyncPlan,
                              abort_in_flight: bool) -> list[ReceiveResult]:
        from . import syncing, weights  # noqa: PLC0415

        if not replica_ids:
            raise InvalidArgument("replica_ids must not be empty", reason=Reason.EMPTY_REPLICA_IDS)
        plan = weights.plan_from_proto(plan_msg, self.config.weight_transfer_timeout_s)
        return await syncing.receive(self.replicas, self._weight_groups(), replica_ids, plan, abort_in_flight)

    async def load_checkpoint(self, replica_ids: list[str], step: str, *, path: str, version: int, update_id: str,
                              keep_previous: bool) -> list[ReceiveResult]:
        """One step of a checkpoint load on this node's replicas (:mod:`replica_agent.checkpoint_load`)."""
        from .checkpoint_load import CheckpointLoads  # noqa: PLC0415 - torch only when weights move

        if self._checkpoint_loads is None:
            self._checkpoint_loads = CheckpointLoads(self.replicas)
        return await self._checkpoint_loads.run(replica_ids, step, path=path, version=version, update_id=update_id,
                                                keep_previous=keep_previous)

    async def send_weights(self, replica_id: str, plan_msg: weights_pb2.WeightSyncPlan) -> SendResult:
        from . import syncing, weights  # noqa: PLC0415

        plan = weights.plan_from_proto(plan_msg, self.config.weight_transfer_timeout_s)
        return await syncing.send(self.replicas, self._weight_groups(), replica_id, plan)

    async def prepare_weight_sync(self, replica_id: str, *, weight_version: int, bucket_size_bytes: int | None,
                                  checksum_algorithm: str | None) -> PreparedSource:
        from weight_transfer import CHECKSUM_ALGORITHMS  # noqa: PLC0415

        from . import syncing  # noqa: PLC0415

        if not replica_id:
            raise InvalidArgument("replica_id must name the source replica", reason=Reason.EMPTY_REPLICA_ID)
        if weight_version < 0:
            raise InvalidArgument(f"weight_version must be >= 0, got {weight_version}", reason=Reason.INVALID_WEIGHT_VERSION)
        if bucket_size_bytes is not None and bucket_size_bytes <= 0:
            raise InvalidArgument("bucket_size_bytes must be positive when set", reason=Reason.INVALID_BUCKET_SIZE)
        if checksum_algorithm is not None and checksum_algorithm not in CHECKSUM_ALGORITHMS:
            raise InvalidArgument(f"checksum_algorithm must be one of {list(CHECKSUM_ALGORITHMS)}, got "
                                  f"{checksum_algorithm!r}", reason=Reason.INVALID_CHECKSUM_ALGORITHM)
        groups = self._weight_groups()
        return await syncing.prepare(
            self.replicas, groups, replica_id, weight_version=weight_version,
            bucket_size_bytes=bucket_size_bytes or groups.config.bucket_size_bytes,
            checksum_algorithm=checksum_algorithm or groups.config.checksum_algorithm,
            host=self.rendezvous_host())

    def rendezvous_host(self) -> str:
        """The host other nodes reach this agent's rendezvous stores on (its advertised host)."""
        import socket  # noqa: PLC0415

        from mesh_runtime.net import parse_host_port  # noqa: PLC0415

        host = parse_host_port(self.address)[0]
        return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host

    def trainer_groups(self) -> GroupWeights:
        """The trainer groups this node's replicas joined (:mod:`replica_agent.group_weights`)."""
        if self._trainer_groups is None:
            from .group_weights import GroupWeights  # noqa: PLC0415 - torch only when weights move

            self._trainer_groups = GroupWeights(self.replicas, self.config.weight_transfer_timeout_s)
        return self._trainer_groups

    async def close_weight_groups(self) -> None:
        if self._groups is not None:
            await asyncio.to_thread(self._groups.close)
        if self._trainer_groups is not None:
            await asyncio.to_thread(self._trainer_groups.close)

    async def _stop_rejected(self, replica_ids: list[str]) -> None:
        for replica_id in replica_ids:
            log.warning("controller rejected replica %s (intentionally removed); stopping it", replica_id)
            await self.serving().stop(replica_id, grace_s=0.0, force=True)

    def replica_proto(self, replica: Replica | ReplicaProcess) -> replica_pb2.Replica:
        if isinstance(replica, ReplicaProcess):
            assert self.processes is not None
            return self.processes.proto(replica, node_address=self.address, backend=self.config.backend,
                                        model=self.config.model)
        return replica.to_proto(node_id=self.node_id, address=self.address, backend=self.config.backend,
                                model=self.config.model)

    def load_report(self, replica: Replica | ReplicaProcess) -> load_pb2.LoadReport:
        if isinstance(replica, ReplicaProcess):
            assert self.processes is not None
            return self.processes.load_report(replica)
        return convert.load_report(replica.engine.load_snapshot(), replica_id=replica.replica_id,
                                   node_id=self.node_id, state=convert.state_enum(replica.state),
                                   kind=convert.KINDS[replica.kind], weight_version=replica.weight_version)

    def registration(self) -> registry_pb2.RegisterNodeRequest:
        replicas = []
        for r in self.serving().list():
            if r.state == "STOPPED":
                continue
            msg = self.replica_proto(r)
            replicas.append(registry_pb2.ReplicaRegistration(
                replica_id=r.replica_id, kind=msg.kind, state=msg.state, weight_version=msg.weight_version,
                slots=msg.slots, memory_fraction=msg.memory_fraction, initial=r.initial, engine_url=r.engine_url,
                data_address=msg.data_address))
        return registry_pb2.RegisterNodeRequest(
            node_id=self.node_id, address=self.address, slots_total=self.serving().slots_total,
            backend=convert.BACKENDS[self.config.backend], model=self.config.model, replicas=replicas,
            agent_version=__version__)

    def metric_families(self) -> list:
        """Gauges of what each replica holds now (its counters and histograms live in :class:`_Timing`)."""
        labels = ["replica_id", "node_id", "kind"]
        running, waiting, kv, version, state = REPLICA_GAUGES
        families = {
            "running": GaugeMetricFamily(running, "Requests being decoded", labels=labels),
            "waiting": GaugeMetricFamily(waiting, "Requests waiting to be admitted", labels=labels),
            "kv": GaugeMetricFamily(kv, "Share of the KV cache (tokens) in use", labels=labels),
            "version": GaugeMetricFamily(version, "Weight version the replica serves", labels=labels),
            "state": GaugeMetricFamily(state, "1 for the replica's current state", labels=[*labels, "state"]),
        }
        for replica in self.serving().list():
            values = [replica.replica_id, self.node_id, replica.kind]
            report = self.load_report(replica)
            families["running"].add_metric(values, report.running_requests)
            families["waiting"].add_metric(values, report.waiting_requests)
            families["kv"].add_metric(values, report.kv_cache_usage)
            families["version"].add_metric(values, replica.weight_version)
            families["state"].add_metric([*values, replica.state], 1)
        return list(families.values())


class _Timing:
    """A replica agent's counters and histograms, by replica."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.tokens = metrics.counter("rollmesh_replica_generated_tokens", "Completion tokens streamed",
                                      ("replica_id",))
        self.requests = metrics.counter("rollmesh_replica_requests", "Generation attempts served, by how they ended "
                                        "(stop, length, aborted, failed)", ("replica_id", "outcome"))
        self.ttft = metrics.histogram("rollmesh_replica_time_to_first_token_seconds",
                                      "Time from a Generate call's arrival to its first token", ("replica_id",))
        self.duration = metrics.histogram("rollmesh_replica_request_duration_seconds",
                                          "Time from a Generate call's arrival to its last message", ("replica_id",))


async def wait_registered(node: Node, timeout_s: float) -> None:
    """Wait until the node holds a lease (tests and tools)."""
    if node.link is None:
        raise RuntimeError("no controller configured")
    await asyncio.wait_for(node.link.registered.wait(), timeout_s)
