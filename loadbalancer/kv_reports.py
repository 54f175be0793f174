"""The replicas' KV capacity from their agents' load reports, for program admission (``program_admission`` with
``kv_tokens`` 0): every ``report_interval_s``, and at once when the table changes, the balancer calls
``GetLoadReports`` on each agent address in its table and tells :class:`~.programs.ProgramAdmission` each routed
replica's ``max_total_tokens``. A table change polls at once only when a routed replica has not reported yet
(every weight version moves the table; capacities do not move with it). An agent that does not answer keeps what it last reported (a replica never
reported admits every program)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from rollmesh.replica.v1 import replica_agent_pb2

from .programs import ProgramAdmission
from .table import RoutingTable

log = logging.getLogger(__name__)


class CapacityReports:
    """See the module docstring."""

    def __init__(self, table: RoutingTable, programs: ProgramAdmission, stub_for: Callable[[str], Any], *,
                 interval_s: float, call_timeout_s: float) -> None:
        self.table = table
        self.programs = programs
        self._stub_for = stub_for
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failing: set[str] = set()
        table.on_change(self._new_replicas)

    def _new_replicas(self) -> None:
        if any(replica_id not in self.programs.capacity for replica_id in self.table.routes):
            self._changed.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll(self) -> None:
        """Read every agent's reports once."""
        addresses = {route.address for route in self.table.routes.values()}
        await asyncio.gather(*(self._read(address) for address in addresses))

    async def _read(self, address: str) -> None:
        try:
            reply = await self._stub_for(address).GetLoadReports(replica_agent_pb2.GetLoadReportsRequest(),
                                                                 timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as err:
            if address not in self._failing:
                self._failing.add(address)
                log.warning("GetLoadReports of agent %s failed (%s %s): its replicas keep the KV capacity "
                            "last reported", address, err.code().name, err.details())
            return
        self._failing.discard(address)
        for report in reply.reports:
            route = self.table.routes.get(report.replica_id)
            if route is not None and route.address == address:
                self.programs.set_capacity(report.replica_id, report.max_total_tokens)

    async def _run(self) -> None:
        while True:
            self._changed.clear()
            await self.poll()
            try:
                await asyncio.wait_for(self._changed.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
