"""Leader or standby: several controllers on one etcd store, exactly one of them acting.

On a SQLite store (the default) the one controller leads. On an etcd store
each controller first tries to own it (:class:`~controller.store_owner.StoreOwnership`:
an etcd lease on ``PREFIX/owner``, every write fenced by its create revision).
The one that owns it is the **leader**: its :class:`~controller.mesh.Mesh` acts
(scheduling, weight syncs, scale operations, autoscaler, leases, routing). The
others are **standbys**: they serve at once, answer reads (``Get*`` / ``List*``)
from a read-only copy of the store reloaded every ``standby_refresh_s``, and
answer every other call with ``UNAVAILABLE`` / ``NOT_LEADER`` naming the
leader's address (:class:`StandbyGate`), which rollmesh's clients follow
(:class:`mesh_runtime.channels.FollowingChannel`). A standby tries to take the
store over at each refresh: within a second of a clean shutdown of the leader
(its lease revoked), within the lease after a crash. It then loads the state
afresh under its own fence and starts acting (a ``store.acquire`` span and an
``EVENT_TYPE_LEADER_CHANGED`` event).

A leader that loses the store (its lease ran out while it was paused or cut
off from etcd's quorum, or a write was fenced) stops acting at once and turns
standby in the same process: its acting tasks are cancelled, its copy of the
state becomes read-only (so reads are still answered while etcd has no
quorum), and it competes for the store again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime import tracing
from mesh_runtime.channels import read_methods
from mesh_runtime.errors import Unavailable
from mesh_runtime.handlers import rewrap
from mesh_runtime.reasons import Reason
from mesh_runtime.retry import RetryPolicy
from mesh_runtime.server import MeshServer

from .config import ControllerConfig
from .mesh import Mesh
from .store_backends import EtcdBackend, StoreBackend, StoreUnavailable, parse_store
from .store_owner import StoreOwnership

log = logging.getLogger(__name__)
STORE_RETRY = RetryPolicy(initial_s=0.2, max_s=2.0)
"""Reaching the state store at start-up: until it answers (there is nothing to serve without it)."""
LEADER, STANDBY = "leader", "standby"
GATED_SERVICES = ("rollmesh.controller.v1.ControllerService", "google.longrunning.Operations")
"""The services whose non-read calls only the leader answers (health and reflection answer everywhere)."""


class Leadership:
    """This controller's role and the mesh it serves from (the leader's, or a standby's read-only copy)."""

    def __init__(self, config: ControllerConfig, tracer_provider: TracerProvider | None, *,
                 on_mesh: Callable[[Mesh], None] = lambda mesh: None) -> None:
        self.config = config
        self.tracer_provider = tracer_provider
        self.tracer = tracing.tracer(tracer_provider, "rollmesh.controller")
        self.on_mesh = on_mesh
        """Told of every new mesh served from (a promotion, a refreshed standby copy)."""
        self.name = f"{config.node_id or socket.gethostname()} at {config.listen} (pid {os.getpid()})"
        self.address = config.advertise_address
        self.leader_name = self.leader_address = ""
        self.ownership: StoreOwnership | None = None
        self._server: MeshServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._standby_since = time.monotonic()
        backend = self._backend()
        if not isinstance(backend, EtcdBackend):
            self.role, self.mesh = LEADER, Mesh(config, tracer_provider, backend=backend)
            self.leader_name = self.name
            return
        self.ownership = self._new_ownership(backend)
        if self._first_attempt():
            self.role = LEADER
            self.mesh = self._leader_mesh()
        else:
            self.role = STANDBY
            self.mesh = self._copy()

    # -------------------------------------------------------------- startup
    def _backend(self) -> StoreBackend | None:
        """A fresh backend (sessions of its own) on the configured store."""
        return parse_store(self.config.store, self.config.state_dir, self.config.store_tls)

    def _new_ownership(self, backend: EtcdBackend) -> StoreOwnership:
        ownership = StoreOwnership(backend, owner=self.name, ttl_s=self.config.store_lease_ttl_s,
                                   on_lost=self._lost)
        ownership.address = self.address
        backend.on_fenced = ownership.lose
        return ownership

    def _first_attempt(self) -> bool:
        """Own the store or learn who does; while etcd cannot be reached at all, wait (nothing to serve)."""
        ownership = self.ownership
        assert ownership is not None

        def attempt() -> bool:
            if ownership.try_acquire():
                return True
            self.leader_name, self.leader_address = ownership.holder_info()
            log.warning("state store %s is led by %s; serving as a standby (reads only) until it can be "
                        "taken over (lease %d s)", ownership.backend.description,
                        self.leader_name or "(nobody yet)", ownership.ttl_s)
            return False

        def unreachable(err: BaseException, wait: float) -> None:
            log.warning("state store %s: %s; retrying in %.1f s", ownership.backend.description, err, wait)

        return STORE_RETRY.run_sync(attempt, retry_if=lambda err: isinstance(err, StoreUnavailable),
                                    on_retry=unreachable)

    def _leader_mesh(self) -> Mesh:
        assert self.ownership is not None
        ownership = self.ownership
        ownership.waited_s = time.monotonic() - self._standby_since
        with self.tracer.start_as_current_span("store.acquire", attributes={
                "rollmesh.store": ownership.backend.description, "rollmesh.owner": ownership.owner,
                "rollmesh.previous_owner": ownership.previous, "rollmesh.waited_s": round(ownership.waited_s, 3),
                "rollmesh.fence_revision": ownership.fence_revision}):
            mesh = Mesh(self.config, self.tracer_provider, backend=ownership.backend, ownership=ownership)
        self.leader_name, self.leader_address = self.name, self.address
        return mesh

    def _copy(self) -> Mesh:
        """A read-only copy of the store's state, on a backend (sessions) of its own."""
        return Mesh(self.config, self.tracer_provider, backend=self._backend(), read_only=True)

    # --------------------------------------------------------------- serving
    async def start(self, server: MeshServer) -> None:
        """Act (leader) or start the standby loop, once the server is bound."""
        self._server = server
        self._loop = asyncio.get_running_loop()
        if not self.address:
            self.address = server.address
        if self.ownership is not None:
            self.ownership.address = self.address
        if self.role == LEADER:
            self.leader_address = self.address
            await self._publish()
            self.mesh.start_acting(server.spawn)
        else:
            server.spawn(self._standby(), name="standby")

    async def _publish(self) -> None:
        if self.ownership is not None:
            try:
                await asyncio.to_thread(self.ownership.publish_address, self.address)
            except StoreUnavailable as err:   # standbys name no address until the next publish; callers rotate
                log.warning("could not publish this leader's address: %s", err)

    async def _standby(self, *, at_once: bool = False) -> None:
        """Try to take the store over every quarter of the lease (at most every ``standby_refresh_s``) and
        reload the copy every ``standby_refresh_s``, until leading (the first time at once for a demoted
        leader: it names the new leader as soon as it can)."""
        assert self.ownership is not None
        poll = min(self.config.standby_refresh_s, max(0.1, self.ownership.ttl_s / 4))
        told, refreshed = "", time.monotonic()
        while True:
            if not at_once:
                await asyncio.sleep(poll)
            try:
                if await asyncio.to_thread(self.ownership.try_acquire):
                    await self._promote()
                    return
                if not at_once and time.monotonic() - refreshed < self.config.standby_refresh_s:
                    continue
                at_once = False
                self.leader_name, self.leader_address = await asyncio.to_thread(self.ownership.holder_info)
                fresh = self._copy()
            except (StoreUnavailable, OSError) as err:
                at_once = False
                if str(err) != told:
                    log.warning("standby: state store unavailable (%s); still answering reads from the copy "
                                "loaded before", err)
                    told = str(err)
                continue
            told, refreshed = "", time.monotonic()
            await self._serve_from(fresh)

    async def _serve_from(self, mesh: Mesh) -> None:
        old, self.mesh = self.mesh, mesh
        self.on_mesh(mesh)
        if old is not mesh:
            await old.close()

    async def _promote(self) -> None:
        assert self._server is not None
        mesh = self._leader_mesh()
        self.role = LEADER
        log.warning("leads the state store %s now (after %s)", mesh.state_store,
                    self.ownership.previous if self.ownership and self.ownership.previous else "nobody")
        await self._serve_from(mesh)
        await self._publish()
        mesh.start_acting(self._server.spawn)

    def _lost(self, why: str) -> None:
        """The store is owned elsewhere now (called from the lease thread or a writer thread)."""
        if self._loop is None:
            log.critical("lost the state store before serving: %s", why)
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._demote(why)))

    async def _demote(self, why: str) -> None:
        """Stop acting at once, keep the state as a read-only copy, compete for the store again."""
        if self.role != LEADER:
            return
        self.role = STANDBY
        self._standby_since = time.monotonic()
        log.critical("stopped acting: lost the state store %s (%s); serving as a standby", self.mesh.state_store,
                     why)
        await self.mesh.stop_acting(Unavailable(
            "this controller stopped leading; resume the stream on the new leader", reason=Reason.NOT_LEADER,
            metadata={"leader": "", "leader_name": ""}, retry_delay_s=1.0))
        self.leader_name = self.leader_address = ""
        assert self._server is not None
        backend = self._backend()
        assert isinstance(backend, EtcdBackend)
        self.ownership = self._new_ownership(backend)
        self._server.spawn(self._standby(at_once=True), name="standby")

    async def close(self) -> None:
        """Shut down: the leader releases the store (a standby takes over at once)."""
        await self.mesh.close()
        if self.ownership is not None and self.role != LEADER:
            self.ownership.release()

    # ---------------------------------------------------------------- gating
    def require_leader(self, method: str) -> None:
        if self.role == LEADER:
            return
        leader = self.leader_address
        raise Unavailable(f"{method} needs the leading controller; this one is a standby (leader: "
                          f"{leader or 'not known yet'})", reason=Reason.NOT_LEADER,
                          metadata={"leader": leader, "leader_name": self.leader_name},
                          retry_delay_s=0.2 if leader else 1.0)

    def status_fields(self) -> dict[str, Any]:
        """GetStatus's role, leader_address and leader_name."""
        from rollmesh.controller.v1 import controller_pb2  # noqa: PLC0415

        role = controller_pb2.CONTROLLER_ROLE_LEADER if self.role == LEADER else controller_pb2.CONTROLLER_ROLE_STANDBY
        return {"role": role, "leader_address": self.leader_address, "leader_name": self.leader_name}


class StandbyGate(grpc.aio.ServerInterceptor):
    """On a standby, every call of the controller's services but the reads fails with NOT_LEADER."""

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership
        self._reads = {f"/{service}/{method}" for service, method in read_methods()}

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self._reads or not method.lstrip("/").startswith(GATED_SERVICES):
            return handler
        name = method.rsplit("/", 1)[-1]
        leadership = self.leadership

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def gated(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                leadership.require_leader(name)
                return await behavior(request_or_iterator, context)
            return gated

        def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def gated(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                leadership.require_leader(name)
                async for item in behavior(request_or_iterator, context):
                    yield item
            return gated

        return rewrap(handler, unary, streaming)
