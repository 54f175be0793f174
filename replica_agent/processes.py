"""Replicas in processes of their own (``replica_processes: true``), supervised by the node's agent.

Each replica runs in a child process (:mod:`replica_agent.replica_process`): a replica agent of one replica,
on a port of its own, without a controller. Its engine and its Generate streams use that process's core, so
a node's token rate grows with its replicas. The node's agent stays the node's one control endpoint: it
launches and stops the processes, forwards every lifecycle call (sleep, wake, pause, abort, weights) to the
replica's process, registers the node with the controller and reports load from what the processes report.
Balancers stream from the replica's process directly: its address is the replica's ``data_address``.

A process that ends without being stopped is a FAILED replica (its slots are freed, the controller routes
around it, as for an engine that dies in process). The child watches this agent: it exits when the agent does.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import grpc

from mesh_runtime import errors
from mesh_runtime.channels import ChannelPool
from mesh_runtime.net import format_host_port, free_port, parse_host_port
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import load_pb2, types_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc, replica_pb2
from rollmesh.weights.v1 import weight_source_pb2_grpc

from . import convert
from .config import ReplicaAgentConfig
from .replicas import ReplicaIndex, check_launch, reserve_slots

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
"""How long a replica process may take to listen (its engine loads afterwards, within LaunchReplica)."""
LAUNCH_TIMEOUT_S = 3600.0
"""How long the replica process may take to start its engine (a large model loads for minutes)."""
REFRESH_S = 0.5
"""How often the agent reads each replica process's state and load (registration, load reports, metrics)."""
STOP_GRACE_S = 10.0
"""How long a replica process may take to exit after SIGTERM before it is killed."""


@dataclasses.dataclass
class ReplicaProcess:
    """One replica and the process that runs it."""

    replica_id: str
    kind: str
    slots: list[int]
    initial: bool
    engine_url: str = ""
    launched_at: float = dataclasses.field(default_factory=time.time)
    address: str = ""
    """Where balancers reach the process (the node's advertised host, the process's port)."""
    metrics_address: str = ""
    """The process's loopback ``/metrics`` (when the agent serves metrics)."""
    process: asyncio.subprocess.Process | None = None
    stub: replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub | None = None
    weights: weight_source_pb2_grpc.WeightSourceServiceAsyncStub | None = None
    replica: replica_pb2.Replica | None = None
    """The process's latest account of the replica."""
    report: load_pb2.LoadReport | None = None
    ended: str = ""
    """Why the process ended without being stopped; empty while it runs."""
    stopping: bool = False
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)

    @property
    def state(self) -> str:
        if self.ended:
            return "FAILED"
        return convert.state_name(self.replica.state) if self.replica is not None else "LAUNCHING"

    @property
    def weight_version(self) -> int:
        return self.replica.weight_version if self.replica is not None else 0


class ReplicaProcesses(ReplicaIndex[ReplicaProcess]):
    """Launches, watches and stops the replica processes of one node (see the module docstring)."""

    def __init__(self, config: ReplicaAgentConfig, *, node_id: str, address: Callable[[], str],
                 pool: ChannelPool) -> None:
        self.config = config
        self.node_id = node_id
        self.slots_total = config.slots
        self._address = address
        self._pool = pool
        self._replicas: dict[str, ReplicaProcess] = {}
        self._slot_owner: dict[int, str] = {}
        self._launch_lock = asyncio.Lock()

    def metrics_addresses(self) -> builtins.list[str]:
        """The ``/metrics`` of every running replica process."""
        return [p.metrics_address for p in self._replicas.values()
                if p.metrics_address and p.stub is not None and not p.ended and p.state != "STOPPED"]

    def running(self, proc: ReplicaProcess) -> replica_agent_pb2_grpc.ReplicaAgentServiceAsyncStub:
        """The stub of a replica whose process runs; FAILED_PRECONDITION for one that ended or stopped."""
        if proc.stub is None or proc.ended or proc.state == "STOPPED":
            raise errors.FailedPrecondition(
                f"replica {proc.replica_id!r} is {proc.state}" + (f": {proc.ended}" if proc.ended else ""),
                reason=Reason.REPLICA_NOT_SERVING, metadata={"replica_id": proc.replica_id})
        return proc.stub

    # --------------------------------------------------------------- lifecycle
    async def launch(self, *, replica_id: str, kind: str, slots: int, memory_fraction: float | None = None,
                     start_asleep: bool = False, weight_version: int = 0, initial: bool = False,
                     engine_url: str = "") -> ReplicaProcess:
        """Reserve slots, start the replica's process and launch the replica in it."""
        check_launch(kind=kind, slots=slots, engine_url=engine_url, memory_fraction=memory_fraction)
        async with self._launch_lock:
            free = reserve_slots(self.node_id, replica_id, self._replicas.get(replica_id), slots, self.slots_total,
                                 self._slot_owner)
            proc = ReplicaProcess(replica_id, kind, free, initial, engine_url)
            self._replicas[replica_id] = proc
        try:
            await self._spawn(proc)
            request = pb.LaunchReplicaRequest(replica_id=replica_id, kind=convert.KINDS[kind], slots=slots,
                                              start_asleep=start_asleep, weight_version=weight_version,
                                              engine_url=engine_url)
            if memory_fraction is not None:
                request.memory_fraction = memory_fraction
            try:
                reply = await self.running(proc).LaunchReplica(request, timeout=LAUNCH_TIMEOUT_S)
            except grpc.aio.AioRpcError as err:
                raise errors.relayed(err) from None
            proc.replica = reply.replica
        except BaseException as exc:
            proc.ended = f"launch failed: {exc}"[:500]
            await self._end(proc)
            raise
        proc.tasks.append(asyncio.create_task(self._refresh(proc), name=f"refresh-{replica_id}"))
        log.info("replica %s (%s) launched in process %s on slots %s, serving at %s: %s", replica_id, kind,
                 proc.process and proc.process.pid, free, proc.address, proc.state)
        return proc

    async def _spawn(self, proc: ReplicaProcess) -> None:
        listen_host = parse_host_port(self.config.listen)[0]
        port = free_port("0.0.0.0" if listen_host in ("", "0.0.0.0") else "::" if listen_host == "::"
                         else listen_host)
        advertised = parse_host_port(self._address())[0]
        proc.address = format_host_port(advertised, port)
        if self.config.metrics_listen:
            proc.metrics_address = format_host_port("127.0.0.1", free_port("127.0.0.1"))
        child = dataclasses.asdict(self.config)
        child.update(listen=format_host_port(listen_host, port), advertise_address=proc.address,
                     controller_address="", metrics_listen=proc.metrics_address, health_listen="", replicas=[],
                     replica_processes=False, slots=max(len(proc.slots), 1), node_id=self.node_id)
        env = dict(os.environ)
        if proc.slots:   # the process sees its own accelerators only, as its slots 0..n-1
            visible = env.get("CUDA_VISIBLE_DEVICES", "")
            devices = visible.split(",") if visible else [str(s) for s in range(self.slots_total)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[s] for s in proc.slots if s < len(devices))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replica_agent.replica_process", str(os.getpid()),
            logging.getLevelName(logging.getLogger().getEffectiveLevel()), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env)
        proc.process = process
        assert process.stdin is not None and process.stdout is not None   # both are pipes
        process.stdin.write(json.dumps(child, default=str).encode())
        await process.stdin.drain()
        process.stdin.close()
        try:
            await asyncio.wait_for(self._listening(process), START_TIMEOUT_S)
        except (asyncio.TimeoutError, EOFError):
            raise errors.Internal(f"replica {proc.replica_id!r}: its process did not start listening within "
                                  f"{START_TIMEOUT_S:g} s (exit code {process.returncode}; its log is in this "
                                  f"agent's stderr)", reason=Reason.REPLICA_PROCESS_FAILED) from None
        proc.tasks.append(asyncio.create_task(self._drain(process), name=f"stdout-{proc.replica_id}"))
        proc.tasks.append(asyncio.create_task(self._watch(proc), name=f"watch-{proc.replica_id}"))
        channel = self._pool.get(proc.address)   # the address balancers use, which its certificate names
        proc.stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
        proc.weights = weight_source_pb2_grpc.WeightSourceServiceStub(channel)

    @staticmethod
    async def _listening(process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while True:
            line = await process.stdout.readline()
            if not line:
                raise EOFError
            if b" listening on " in line:
                return

    @staticmethod
    async def _drain(process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while await process.stdout.readline():
            pass

    async def _watch(self, proc: ReplicaProcess) -> None:
        process = proc.process
        assert process is not None
        code = await process.wait()
        if proc.stopping or proc.ended:
            return
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        proc.ended = f"replica process {process.pid} ended ({how})"
        log.warning("replica %s: %s -> FAILED (%s)", proc.replica_id, proc.replica and
                    convert.state_name(proc.replica.state), proc.ended, extra={"replica_id": proc.replica_id})
        self._release(proc)

    async def _refresh(self, proc: ReplicaProcess) -> None:
        stub = proc.stub
        assert stub is not None
        while not proc.ended and not proc.stopping:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.GetLoadReports(pb.GetLoadReportsRequest(replica_ids=[proc.replica_id]),
                                                  timeout=5.0)
                if reply.reports:
                    proc.report = reply.reports[0]
                got = await stub.GetReplica(pb.GetReplicaRequest(replica_id=proc.replica_id), timeout=5.0)
                proc.replica = got.replica
            await asyncio.sleep(REFRESH_S)

    def _release(self, proc: ReplicaProcess) -> None:
        for slot in proc.slots:
            if self._slot_owner.get(slot) == proc.replica_id:
                del self._slot_owner[slot]

    async def _end(self, proc: ReplicaProcess) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`) and free its slots."""
        process = proc.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for task in proc.tasks:
            task.cancel()
        self._release(proc)

    async def stop(self, replica_id: str, *, grace_s: float, force: bool) -> ReplicaProcess:
        """Stop the replica in its process (drain unless ``force``), then end the process."""
        proc = self.get(replica_id)
        if proc.state == "STOPPED":
            return proc
        proc.stopping = True
        try:
            if (proc.stub is not None and not proc.ended and proc.process is not None
                    and proc.process.returncode is None):
                request = pb.StopReplicaRequest(replica_id=replica_id, force=force)
                request.grace.FromNanoseconds(int(grace_s * 1e9))
                with contextlib.suppress(grpc.aio.AioRpcError):
                    proc.replica = (await proc.stub.StopReplica(request, timeout=grace_s + 30.0)).replica
        finally:
            await self._end(proc)
            proc.ended = ""
            if proc.replica is None:
                proc.replica = replica_pb2.Replica(replica_id=replica_id)
            proc.replica.state = types_pb2.REPLICA_STATE_STOPPED
            proc.replica.state_reason = "stopped" + (" (forced)" if force else "")
            proc.replica.in_flight_requests = 0
        log.info("replica %s: process ended, STOPPED", replica_id, extra={"replica_id": replica_id})
        return proc

    async def close(self) -> None:
        """Stop every replica and end its process (at the agent's shutdown)."""
        for proc in list(self._replicas.values()):
            if proc.state != "STOPPED":
                with contextlib.suppress(Exception):
                    await self.stop(proc.replica_id, grace_s=0.0, force=True)
        await self._pool.close()

    # ----------------------------------------------------------------- views
    def proto(self, proc: ReplicaProcess, *, node_address: str, backend: str, model: str) -> replica_pb2.Replica:
        """The replica as this node presents it: the process's account, this node's slots and addresses."""
        msg = replica_pb2.Replica()
        if proc.replica is not None:
            msg.CopyFrom(proc.replica)
        else:
            msg.replica_id, msg.state = proc.replica_id, types_pb2.REPLICA_STATE_LAUNCHING
            msg.kind, msg.initial = convert.KINDS[proc.kind], proc.initial
            msg.backend, msg.model = convert.BACKENDS[backend], model
            msg.launched_at.FromNanoseconds(int(proc.launched_at * 1e9))
        msg.node_id, msg.address, msg.initial = self.node_id, node_address, proc.initial
        msg.data_address = proc.address if proc.state != "STOPPED" else ""
        msg.slots[:] = proc.slots
        if proc.ended:
            msg.state, msg.state_reason, msg.in_flight_requests = types_pb2.REPLICA_STATE_FAILED, proc.ended, 0
        return msg

    def load_report(self, proc: ReplicaProcess) -> load_pb2.LoadReport:
        report = load_pb2.LoadReport()
        if proc.report is not None:
            report.CopyFrom(proc.report)
        report.replica_id, report.node_id = proc.replica_id, self.node_id
        report.kind = convert.KINDS[proc.kind]
        report.state = convert.state_enum(proc.state)
        report.weight_version = proc.weight_version
        if proc.ended:
            report.running_requests = report.waiting_requests = 0
        return report
