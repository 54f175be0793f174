"""The replica processes' own counters and histograms on their agent's ``/metrics``.

With ``replica_processes`` each replica counts its tokens, requests, time to first token and durations in
its own process, which serves them on a loopback ``/metrics`` port of its own. At each scrape of the agent,
:meth:`ChildMetrics.gather` reads every live process's exposition (concurrently, without blocking the event
loop) and :meth:`ChildMetrics.families` merges their ``rollmesh_replica_*`` families into one per name, so
the node's endpoint shows what an agent with in-process replicas shows. The replica gauges (running,
waiting, KV use, version, state) stay the agent's own, from the processes' load reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from mesh_runtime.net import parse_host_port

log = logging.getLogger(__name__)

PREFIX = "rollmesh_replica_"
FETCH_TIMEOUT_S = 2.0


async def fetch_metrics(address: str, timeout_s: float = FETCH_TIMEOUT_S) -> str:
    """The text exposition served at ``http://ADDRESS/metrics``."""
    host, port = parse_host_port(address)

    async def get() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    raw = await asyncio.wait_for(get(), timeout_s)
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise OSError(f"GET http://{address}/metrics answered {head.splitlines()[0][:60]!r}")
    return body.decode()


class ChildMetrics:
    """What the replica processes last reported, by ``/metrics`` address (see the module docstring)."""

    def __init__(self, skip: Iterable[str] = ()) -> None:
        self._skip = set(skip)
        self._latest: dict[str, list[Metric]] = {}

    async def gather(self, addresses: Iterable[str]) -> None:
        addresses = list(addresses)

        async def one(address: str) -> tuple[str, list[Metric] | None]:
            try:
                text = await fetch_metrics(address)
            except (OSError, asyncio.TimeoutError) as err:
                log.debug("metrics of replica process at %s not read: %s", address, err)
                return address, None
            return address, [f for f in text_string_to_metric_families(text)
                              if f.name.startswith(PREFIX) and f.name not in self._skip]

        results = await asyncio.gather(*(one(a) for a in addresses))
        self._latest = {a: families for a, families in results if families is not None}

    def families(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for families in self._latest.values():
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
                into.samples.extend(family.samples)
        return list(merged.values())
