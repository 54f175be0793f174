"""The bootstrap every rollmesh server shares.

:class:`MeshServer` owns one ``grpc.aio`` server with the project's services
plus ``grpc.health.v1`` and server reflection, the request-decoding, tracing
and error-mapping interceptors, background tasks, and an orderly, idempotent
shutdown. One server per port: ``SO_REUSEPORT`` is off (gRPC turns it on by
default, which lets a second process bind the same port and take half the
traffic), so a port in use fails with :class:`PortInUse`. The shutdown:
health NOT_SERVING -> stop accepting and drain in-flight RPCs within the grace
period -> cancel background tasks -> run cleanups (close channels) -> flush spans.
:func:`serve_until_signalled` runs a server until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from . import sdnotify, tracing
from .authorization import TokenCheck
from .config import TlsConfig
from .metrics import MetricsEndpoint, ServerMetrics
from .pipeline import ServerPipeline
from .net import format_host_port, is_loopback, parse_host_port
from .tls import server_credentials

log = logging.getLogger(__name__)

_MIN_CLEANUP_S = 2.0  # even a zero-grace stop lets cleanups close channels

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
"""Options of every rollmesh gRPC server: one server per port; messages up to the size rollmesh's channels
send and accept (a prompt of a million tokens fits)."""


class PortInUse(OSError):
    """The listen address is taken (another server, or anything else, is bound to it)."""


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service to serve: its full name, its servicer and the generated adder."""

    full_name: str
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


class MeshServer:
    """A rollmesh gRPC server: project services + health + reflection + tracing."""

    def __init__(self, *, server_name: str, listen: str, services: Sequence[ServiceBinding],
                 tracer_provider: TracerProvider | None = None,
                 shutdown_grace_s: float = 10.0,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 tls: TlsConfig | None = None, insecure: bool = False, health_listen: str = "",
                 token_check: TokenCheck | None = None, metrics: ServerMetrics | None = None,
                 metrics_listen: str = "", admit_own_identity: bool = False) -> None:
        """``admit_own_identity``: callers with this server's own certificate identity may call every method
        that has an authorization rule (a replica process, which its agent's certificate names too)."""
        self.server_name = server_name
        self.listen = listen
        self.tls = tls
        self.insecure = insecure
        self.health_listen = health_listen
        self.identity = tls.identity() if tls is not None else None
        self.metrics = metrics
        self.metrics_listen = metrics_listen
        self.services = list(services)
        self.tracer_provider = tracer_provider
        self.shutdown_grace_s = shutdown_grace_s
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()
        # one wrapping per method: count, decode, map errors, trace, authorize (mutual TLS), check required
        # fields; the server's own interceptors run inside it
        self._interceptors = [ServerPipeline(metrics=metrics, tracer_provider=tracer_provider,
                                             authorization=tls is not None, token_check=token_check,
                                             own=self.identity if admit_own_identity else None),
                              *interceptors]
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self._health = health.aio.HealthServicer()
        self._tasks: set[asyncio.Task] = set()
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._stopping: asyncio.Task | None = None
        self._on_start: list[Callable[[MeshServer], Awaitable[None]]] = []
        self.ready = False
        self.port: int | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` actually bound (the real port when 0 was asked for)."""
        host, _ = parse_host_port(self.listen)
        return format_host_port(host, self.port or 0)

    @property
    def transport_security(self) -> str:
        """``mutual_tls``, ``plaintext_loopback`` or ``plaintext_insecure``."""
        if self.tls is not None:
            return "mutual_tls"
        return "plaintext_insecure" if self.insecure and not is_loopback(parse_host_port(self.listen)[0]) \
            else "plaintext_loopback"

    def uptime_s(self) -> float:
        return time.monotonic() - self._started_monotonic

    async def start(self) -> int:
        """Bind, start serving and mark every service SERVING; returns the port."""
        server = grpc.aio.server(interceptors=self._interceptors, options=SERVER_OPTIONS)
        for binding in self.services:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [b.full_name for b in self.services] + [HEALTH_SERVICE, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        if self.tls is None and self.transport_security == "plaintext_insecure":
            log.warning("%s serves PLAINTEXT on %s (--insecure): anyone who reaches it can call every RPC; "
                        "configure tls (rollmesh certs) instead", self.server_name, self.listen)
        port = _bind(server, self.listen, server_credentials(self.tls) if self.tls is not None else None)
        if self.health_listen:
            self._health_server = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = _bind(self._health_server, self.health_listen, None)
            await self._health_server.start()
        self._server = server
        self.port = port
        await server.start()
        if self.metrics is not None and self.metrics_listen:
            endpoint = MetricsEndpoint(self.metrics_listen, self.metrics)
            log.info("Prometheus metrics on http://%s/metrics", await endpoint.start())
            self.add_cleanup(endpoint.close)
        for hook in self._on_start:
            await hook(self)
        for name in ["", *[b.full_name for b in self.services]]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.ready = True
        return port

    def health_address(self) -> str:
        host, _ = parse_host_port(self.health_listen)
        return format_host_port(host, self.health_port or 0)

    def on_start(self, hook: Callable[[MeshServer], Awaitable[None]]) -> None:
        """Run ``hook(server)`` after binding, before the server reports SERVING."""
        self._on_start.append(hook)

    def spawn(self, coro: Coroutine, *, name: str | None = None) -> asyncio.Task:
        """Run a background task that is cancelled at shutdown; failures are logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def add_cleanup(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Register an async cleanup (close a channel, flush a store) run at shutdown."""
        self._cleanups.append(cleanup)

    async def stop(self, grace_s: float | None = None) -> None:
        """Shut down in order; safe to call more than once or concurrently."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float | None) -> None:
        grace = self.shutdown_grace_s if grace_s is None else grace_s
        self.ready = False
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for cleanup in reversed(self._cleanups):
            try:
                await asyncio.wait_for(cleanup(), timeout=max(grace, _MIN_CLEANUP_S))
            except Exception:  # noqa: BLE001 - shutdown continues past a failing cleanup
                log.exception("cleanup failed during shutdown")
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(timeout_millis=int(grace * 1000))

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as err:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise PortInUse(f"cannot listen on {listen}: the address is in use or not available ({err})") from None
    if port == 0:
        raise PortInUse(f"cannot listen on {listen}: the address is in use or not available")
    return port


async def serve_until_signalled(server: MeshServer, *, on_ready: Callable[[MeshServer], None] | None = None,
                                env: Mapping[str, str] | None = None) -> None:
    """Start ``server``, announce readiness (stdout, and systemd when ``env`` has ``NOTIFY_SOCKET``), and
    stop it cleanly on SIGTERM/SIGINT."""
    env = env or {}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        if on_ready is not None:
            on_ready(server)
        log.info("%s: transport %s%s", server.server_name, server.transport_security,
                 f", identity {server.identity}" if server.identity else "")
        print(f"rollmesh {server.server_name} listening on {server.address}", flush=True)
        sdnotify.notify(f"READY=1\nSTATUS=serving on {server.address}", env)
        await stop.wait()
        log.info("%s: shutdown requested", server.server_name)
        sdnotify.notify("STOPPING=1", env)
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        if server.tracer_provider is not None:
            server.tracer_provider.shutdown()
        sys.stdout.flush()


async def serve_config(server_name: str, config: Any, env: dict[str, str],
                       build: Callable[[Any, TracerProvider], MeshServer]) -> None:
    """Run one server process: tracing named ``rollmesh-<server>``, then serve until signalled."""
    provider = tracing.create_tracer_provider(f"rollmesh-{server_name}", env)
    tracing.install_global(provider)
    await serve_until_signalled(build(config, provider), env=env)



@dataclass(frozen=True)
class ServerSpec:
    """Everything that makes one rollmesh server process out of one project service.

    ``make_servicer(config, tracer_provider)`` builds the servicer; it must carry a
    ``status`` (:class:`~mesh_runtime.status.StatusReporter`), and may define
    ``async attach(server)`` to start background work once the server exists and
    ``also_serves``, the :class:`ServiceBinding` of further services the process
    serves (the agents' shared ``WeightSourceService``), and ``interceptors``, innermost server interceptors
    of its own (the controller's standby gate).
    """

    name: str
    config_class: type
    env_prefix: str
    descriptor: Any
    make_servicer: Callable[[Any, TracerProvider | None], Any]
    add_to_server: Callable[[Any, grpc.aio.Server], None]

    def build(self, config: Any, tracer_provider: TracerProvider | None = None) -> MeshServer:
        servicer = self.make_servicer(config, tracer_provider)
        server = MeshServer(server_name=self.name, listen=config.listen,
                            services=[ServiceBinding(self.descriptor.full_name, servicer, self.add_to_server),
                                      *getattr(servicer, "also_serves", ())],
                            tracer_provider=tracer_provider, shutdown_grace_s=config.shutdown_grace_s,
                            tls=config.tls, insecure=config.insecure, health_listen=config.health_listen,
                            token_check=getattr(servicer, "token_check", None),
                            metrics=getattr(servicer, "metrics", None),
                            interceptors=getattr(servicer, "interceptors", ()),
                            metrics_listen=getattr(config, "metrics_listen", ""),
                            admit_own_identity=getattr(servicer, "admits_own_identity", False))
        servicer.status.bind(server)
        attach = getattr(servicer, "attach", None)
        if attach is not None:
            server.on_start(attach)
        return server

    async def create(self, config: Any, tracer_provider: TracerProvider | None = None) -> tuple[MeshServer, int]:
        """Build and start the server (tests bind ``listen`` to port 0)."""
        server = self.build(config, tracer_provider)
        return server, await server.start()

    async def serve(self, config: Any, env: dict[str, str]) -> None:
        """Run this server as the process's one server until SIGTERM/SIGINT."""
        await serve_config(self.name, config, env, self.build)
