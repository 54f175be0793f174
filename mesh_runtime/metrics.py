"""Prometheus metrics by the book, the same on every server (the official ``prometheus_client``).

Each server owns one :class:`ServerMetrics`: a registry holding the process
metrics (``process_*``, ``python_gc_*``, ``python_info``), the per-RPC gRPC
server metrics counted by :class:`~mesh_runtime.pipeline.ServerPipeline` (``grpc_server_handled_total``
by service, method and code; ``grpc_server_handling_seconds``), and the
server's own counters, histograms and state gauges. Names follow the
Prometheus guide: base units (``_seconds``, ``_bytes``), ``_total`` on
counters, ``_ratio`` on ratios, help texts that say what is measured;
counters for what happens, histograms for what takes time, gauges only for
states and sizes. Values derived from state at scrape time come from
collectors registered with :meth:`ServerMetrics.on_scrape`.

:class:`MetricsEndpoint` serves ``GET``/``HEAD /metrics`` (text format 0.0.4)
on its own asyncio listener; anything else is 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import gc_collector, platform_collector, process_collector
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .net import format_host_port, parse_host_port

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
"""Seconds, from a millisecond RPC to a long generation or a weight sync."""
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _Callback(Collector):
    def __init__(self, collect: Callable[[], Iterable]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


class ServerMetrics:
    """One server's registry: process metrics, gRPC server metrics and the server's own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._before: list[Callable[[], Awaitable[None]]] = []
        process_collector.ProcessCollector(registry=self.registry)
        platform_collector.PlatformCollector(registry=self.registry)
        gc_collector.GCCollector(registry=self.registry)
        self.rpc_handled = self.counter(
            "grpc_server_handled", "RPCs completed by this server, by service, method and status code",
            ("grpc_service", "grpc_method", "grpc_code"))
        self.rpc_seconds = self.histogram(
            "grpc_server_handling_seconds", "Time from an RPC's arrival to its last response message",
            ("grpc_service", "grpc_method"))

    def counter(self, name: str, help: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(name, help, tuple(labels), registry=self.registry)

    def histogram(self, name: str, help: str, labels: Iterable[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, help, tuple(labels), buckets=tuple(buckets), registry=self.registry)

    def gauge(self, name: str, help: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, help, tuple(labels), registry=self.registry)

    def on_scrape(self, collect: Callable[[], Iterable]) -> None:
        """Add metric families computed from current state at each scrape (``prometheus_client.core``)."""
        self.registry.register(_Callback(collect))

    def before_scrape(self, gather: Callable[[], Awaitable[None]]) -> None:
        """Await ``gather`` before each scrape's collection (what an :meth:`on_scrape` collector reads from
        other processes, fetched without blocking the event loop)."""
        self._before.append(gather)

    async def gathered_exposition(self) -> bytes:
        """The exposition after the :meth:`before_scrape` hooks (a failed one is logged, not fatal)."""
        for gather in self._before:
            try:
                await gather()
            except Exception:  # noqa: BLE001 - a scrape still answers with what this process knows
                log.exception("metrics: gathering before the scrape failed")
        return self.exposition()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def rpc_code(context: grpc.aio.ServicerContext, failed: BaseException | None) -> str:
    """The status code name a call ended with (``failed``: what its handler raised, if anything)."""
    code = None
    with contextlib.suppress(Exception):
        code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(failed, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    if failed is not None:
        return grpc.StatusCode.UNKNOWN.name
    return grpc.StatusCode.OK.name


class MetricsEndpoint:
    """Serves ``GET /metrics`` (and ``HEAD``) on ``listen`` with ``metrics``' exposition."""

    def __init__(self, listen: str, metrics: ServerMetrics) -> None:
        self.listen = listen
        self._metrics = metrics
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    async def start(self) -> str:
        host, port = parse_host_port(self.listen)
        self._server = await asyncio.start_server(self._handle, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = format_host_port(host, bound[1])
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode(errors="replace").split()
            method = parts[0] if parts else ""
            if len(parts) >= 2 and method in ("GET", "HEAD") and parts[1].split("?")[0] == "/metrics":
                body, status, ctype = await self._metrics.gathered_exposition(), "200 OK", CONTENT_TYPE_LATEST
            else:
                body, status, ctype = b"not found; try GET /metrics\n", "404 Not Found", "text/plain"
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError) as err:
            log.debug("metrics request failed: %s", err)
        except Exception:  # noqa: BLE001 - a broken collector must not kill the endpoint
            log.exception("metrics collection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class LoopStallMonitor:
    """Measures how late the event loop runs a timer: a stall of the loop is every RPC's latency.

    Ticks every ``tick_s``; ``rollmesh_event_loop_stall_seconds`` is the worst lateness within the last
    completed one-second window, and the histogram ``rollmesh_event_loop_lateness_seconds`` keeps every
    tick's lateness.
    """

    def __init__(self, metrics: ServerMetrics, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self.worst_last_second = 0.0
        self._gauge = metrics.gauge("rollmesh_event_loop_stall_seconds",
                                    "Worst lateness of the event loop within the last completed second")
        self._histogram = metrics.histogram("rollmesh_event_loop_lateness_seconds",
                                            "How late the event loop ran each timer tick",
                                            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        window_ends, worst = loop.time() + 1.0, 0.0
        while True:
            due = loop.time() + self.tick_s
            await asyncio.sleep(self.tick_s)
            late = max(0.0, loop.time() - due)
            self._histogram.observe(late)
            worst = max(worst, late)
            if loop.time() >= window_ends:
                self.worst_last_second, worst = worst, 0.0
                self._gauge.set(self.worst_last_second)
                window_ends = loop.time() + 1.0
