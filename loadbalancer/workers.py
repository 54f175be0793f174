"""``rollmesh lb --workers N``: N balancer processes on one host, so the balancer uses N cores.

The balancers share nothing (each keeps its own table and completed-request
records), so they scale as separate hosts' balancers do: each one registers
with the controller under its own id and address, the controller fills its
table, and clients spread requests over the registered set by the consistent
hash of ``request_id`` they already use. This process only supervises: it
starts worker ``i`` as ``rollmesh lb`` from a config file of its own
(:func:`worker_config`: the effective config with ``workers: 1``, port + i of
``listen`` and of ``advertise_address``, ``metrics_listen``, ``http_listen``, ``health_listen``
when they are set, port 0 staying 0, and ``balancer_id`` ``<id>-w<i>``);
relays their output; starts a worker again when it dies (at most once a
second); and on SIGTERM or SIGINT passes the signal on and waits for all of
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from mesh_runtime.config import ConfigError
from mesh_runtime.net import parse_host_port

RESTART_DELAY_S = 1.0


def shifted(address: str, offset: int) -> str:
    """``address`` with its port moved by ``offset`` (port 0, any free port, stays 0)."""
    if not address:
        return address
    host, port = parse_host_port(address)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port + offset if port else 0}"


def worker_config(config: Any, index: int, base_id: str) -> Any:
    """The config of worker ``index`` of ``config`` (see the module docstring)."""
    return dataclasses.replace(
        config, workers=1, listen=shifted(config.listen, index),
        balancer_id=f"{base_id}-w{index}" if base_id else "",
        advertise_address=shifted(config.advertise_address, index),
        metrics_listen=shifted(config.metrics_listen, index), http_listen=shifted(config.http_listen, index),
        health_listen=shifted(config.health_listen, index))


def check_workers(config: Any) -> None:
    """What several workers need: a controller to register with (the clients find them there)."""
    if config.workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {config.workers}")
    if config.workers > 1 and not config.controller_address:
        raise ConfigError("workers", "several workers register with a controller, which lists them to the "
                                     "clients: set controller_address")
    if config.workers > 1 and config.advertise_address and not parse_host_port(config.advertise_address)[1]:
        raise ConfigError("advertise_address", "needs a port with several workers (worker i advertises port + i)")


async def serve_workers(config: Any, directory: Path, env: dict[str, str], base_id: str) -> None:
    """Run ``config.workers`` balancer processes, their config files in ``directory``, until signalled."""
    child_env = {k: v for k, v in env.items() if not k.startswith("ROLLMESH_LB__")}   # the files say it all
    paths = []
    for index in range(config.workers):
        paths.append(directory / f"lb-w{index}.yaml")
        paths[-1].write_text(yaml.safe_dump(dataclasses.asdict(worker_config(config, index, base_id))))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(_supervise(i, path, child_env, stop) for i, path in enumerate(paths)))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


async def _supervise(index: int, path: Path, env: dict[str, str], stop: asyncio.Event) -> None:
    command = [sys.executable, "-m", "launcher.cli", "lb", "--config", str(path)]
    while not stop.is_set():
        proc = await asyncio.create_subprocess_exec(*command, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        relay = asyncio.ensure_future(_relay(proc))
        stopping = asyncio.ensure_future(stop.wait())
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({stopping, exited}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await exited
        stopping.cancel()
        await relay
        if stop.is_set():
            return
        print(f"rollmesh lb: worker {index} exited with {code}; starting it again", file=sys.stderr, flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), RESTART_DELAY_S)


async def _relay(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
