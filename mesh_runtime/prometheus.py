"""A small Prometheus text-format endpoint (``GET /metrics``) for any server.

Servers register a collector returning :class:`Metric` families; each scrape
calls the collectors, so values are always current. Plain asyncio, no extra
dependency; anything but ``GET /metrics`` gets 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .net import format_host_port, parse_host_port

log = logging.getLogger(__name__)


@dataclass
class Metric:
    """One metric family: name, help, type and labelled samples."""

    name: str
    help: str
    type: str = "gauge"
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Metric:
        self.samples.append((labels, float(value)))
        return self


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render(metrics: Iterable[Metric]) -> str:
    """The Prometheus text exposition of ``metrics``."""
    lines: list[str] = []
    for metric in metrics:
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {metric.type}")
        for labels, value in metric.samples:
            label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
            lines.append(f"{metric.name}{{{label_text}}} {_number(value)}" if label_text
                         else f"{metric.name} {_number(value)}")
    return "\n".join(lines) + "\n"


class MetricsEndpoint:
    """Serves ``GET /metrics`` on ``listen`` with the output of ``collect()``."""

    def __init__(self, listen: str, collect: Callable[[], Iterable[Metric]]) -> None:
        self.listen = listen
        self._collect = collect
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
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body, status = render(self._collect()).encode(), "200 OK"
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            else:
                body, status, ctype = b"not found; try GET /metrics\n", "404 Not Found", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError) as err:
            log.debug("metrics request failed: %s", err)
        except Exception:  # noqa: BLE001 - a broken collector must not kill the endpoint
            log.exception("metrics collection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
