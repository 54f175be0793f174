"""The load balancers of a mesh: those configured in ``load_balancer_address`` and those that register.

:class:`Balancers` holds the core membership (:class:`~controller.core.balancers.BalancerRegistry`),
persists it, expires the leases of balancers that stopped calling ``RegisterBalancer``, and answers the
three balancer RPCs. The routing port (:class:`~controller.ports.LoadBalancerRouting`) sends every routing
change to the balancers of :meth:`Balancers.addresses`; the routing reconciliation fills a new member's table
at once (:meth:`wake_reconcile`) and records, per balancer, whether its table is filled and it answered
(:meth:`after_round`): ``ListBalancers(ready_only)`` is what clients spread their requests over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from mesh_runtime.channels import address_list
from mesh_runtime.errors import PermissionDenied
from mesh_runtime.identity import current_identity
from mesh_runtime.reasons import Reason
from mesh_runtime.validate import check_address, check_id
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from rollmesh.controller.v1 import registry_pb2

from . import convert
from .core.balancers import BalancerRegistry

if TYPE_CHECKING:
    from .store import StateStore

log = logging.getLogger(__name__)
KEY = "balancers"


def require_own_balancer(balancer_id: str, method: str) -> None:
    """A balancer's identity may register and deregister only the balancer its certificate names, and that
    name's workers (``<name>-w<i>``, the processes of ``rollmesh lb --workers``)."""
    identity = current_identity()
    if identity is not None and identity.role == "lb" and not _own(identity.name, balancer_id):
        raise PermissionDenied(f"{method}: {identity} may act only for balancer {identity.name!r}, "
                               f"not {balancer_id[:64]!r}", reason=Reason.NOT_YOUR_BALANCER)


def _own(name: str, balancer_id: str) -> bool:
    worker = balancer_id.removeprefix(f"{name}-w")
    return balancer_id == name or (worker != balancer_id and worker.isdigit())


class Balancers:
    """The configured (``load_balancer_address``) and the registered balancers of one controller; their
    registry is durable in ``store`` (``commit`` makes a change durable), events go to ``emit``, spans come
    from ``span``."""

    def __init__(self, load_balancer_address: str, *, lease_ttl_s: float, store: StateStore,
                 clock: Callable[[], float], emit: Callable[..., Any],
                 span: Callable[..., AbstractContextManager[Any]], commit: Callable[[], Awaitable[None]]) -> None:
        self.configured = address_list(load_balancer_address)
        self.registry = BalancerRegistry(clock=clock, emit=emit, lease_ttl_s=lease_ttl_s)
        self.store, self.clock, self.span, self.commit = store, clock, span, commit
        saved = store.load(KEY, state_pb2.BalancersDocument)
        if saved is not None:
            self.registry.restore(saved)
        store.track(KEY, self.registry.to_document)
        self._wakeup = asyncio.Event()
        self._wakeup.set()   # the first round right away: restored and configured balancers are filled at once

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a balancer renews its lease: four calls per lease, so one lost call costs nothing."""
        return self.registry.lease_ttl_s / 4

    def registered(self) -> list[str]:
        """Addresses of the registered balancers (not the configured ones)."""
        return self.registry.addresses()

    # ------------------------------------------------------------------ RPCs
    async def register(self, request: registry_pb2.RegisterBalancerRequest) -> registry_pb2.RegisterBalancerResponse:
        check_id(request.balancer_id, "balancer_id")
        check_address(request.address, "address")
        require_own_balancer(request.balancer_id, "RegisterBalancer")
        if request.address in self.configured:
            log.info("balancer %s registers at %s, which load_balancer_address names too: it is kept in line once",
                     request.balancer_id, request.address)
        with self.span("registry.register_balancer", balancer_id=request.balancer_id, address=request.address):
            member, changed, fresh = self.registry.register(request.balancer_id, request.address, request.version,
                                                            request.instance_id)
            if changed or fresh:
                self.store.mark(KEY)
                await self.commit()   # a new member is durable before it is acknowledged
                self.wake_reconcile()
        reply = registry_pb2.RegisterBalancerResponse(routing_ready=member.address in self.registry.ready)
        reply.lease_ttl.CopyFrom(convert.duration(self.registry.lease_ttl_s))
        reply.heartbeat_interval.CopyFrom(convert.duration(self.heartbeat_interval_s))
        reply.lease_expires_at.CopyFrom(convert.timestamp(member.lease_expires_at))
        return reply

    async def deregister(self, request: registry_pb2.DeregisterBalancerRequest
                         ) -> registry_pb2.DeregisterBalancerResponse:
        check_id(request.balancer_id, "balancer_id")
        require_own_balancer(request.balancer_id, "DeregisterBalancer")
        self.registry.deregister(request.balancer_id, request.reason[:200])
        self.store.mark(KEY)
        await self.commit()
        return registry_pb2.DeregisterBalancerResponse()

    def records(self, *, ready_only: bool = False) -> list[registry_pb2.BalancerRecord]:
        """Every balancer, ordered by id; with ``ready_only`` those clients should send requests to."""
        ready = self.registry.ready
        now = self.clock()
        records = [registry_pb2.BalancerRecord(balancer_id=address, address=address, configured=True,
                                               lease_held=True, routing_ready=address in ready)
                   for address in self.configured]
        for member in self.registry.members():
            if member.address in self.configured:
                continue
            record = registry_pb2.BalancerRecord(balancer_id=member.balancer_id, address=member.address,
                                                 version=member.version, lease_held=member.lease_expires_at > now,
                                                 routing_ready=member.address in ready)
            record.registered_at.CopyFrom(convert.timestamp(member.registered_at))
            record.lease_expires_at.CopyFrom(convert.timestamp(member.lease_expires_at))
            records.append(record)
        records.sort(key=lambda r: r.balancer_id)
        return [r for r in records if r.routing_ready and r.lease_held] if ready_only else records

    # ------------------------------------------------------- leases, rounds
    def expire(self) -> None:
        if self.registry.expire():   # each lapse is an event (logged as a warning by the event log)
            self.store.mark(KEY)

    async def run_leases(self) -> None:
        interval = min(1.0, self.registry.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - leases must keep being checked after one bad round
                log.exception("checking balancer leases failed")

    def wake_reconcile(self) -> None:
        """Run the next routing reconcile round now (a new balancer's table is empty)."""
        self._wakeup.set()

    async def until_next_round(self, interval_s: float) -> None:
        """Sleep ``interval_s``, or less when :meth:`wake_reconcile` is called."""
        try:
            await asyncio.wait_for(self._wakeup.wait(), interval_s)
        except TimeoutError:
            pass
        self._wakeup.clear()

    def after_round(self, address: str, ok: bool) -> None:
        """A reconcile round filled the table of the balancer at ``address`` (``ok``) or could not reach it."""
        if self.registry.set_ready(address, ok):
            log.info("balancer %s is %s", address, "ready: its routing table is filled" if ok
                     else "not ready: it did not answer the routing reconcile round")
            self.store.mark(KEY)
