"""A replica's own process: ``python -m replica_agent.replica_process AGENT_PID`` (started by
:mod:`replica_agent.processes`, never by hand).

It reads its configuration (a replica agent's, as JSON) from stdin, serves one replica agent without a
controller, prints the line ``rollmesh replica-agent listening on HOST:PORT`` when it listens, and exits when
the agent that started it is gone (SIGTERM to itself, so it shuts down as on any stop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys

from opentelemetry.sdk.trace import TracerProvider

from mesh_runtime.config import ConfigError, load_config
from mesh_runtime import event_loop, logs

from .config import ReplicaAgentConfig
from .server import SPEC, make_servicer
from .service import ReplicaAgentServicer

PARENT_POLL_S = 1.0


def _servicer(config: ReplicaAgentConfig, tracer_provider: TracerProvider | None) -> ReplicaAgentServicer:
    servicer = make_servicer(config, tracer_provider)
    servicer.admits_own_identity = True   # its agent forwards the controller's calls with the same certificate
    return servicer


CHILD = dataclasses.replace(SPEC, name="replica-process", make_servicer=_servicer)


async def _follow_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    logging.getLogger(__name__).warning("the agent (process %d) is gone; stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


async def _run(config: ReplicaAgentConfig, parent: int) -> None:
    watcher = asyncio.create_task(_follow_parent(parent))
    try:
        await CHILD.serve(config, dict(os.environ))
    finally:
        watcher.cancel()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[0].isdigit():
        print("usage: python -m replica_agent.replica_process AGENT_PID LOG_LEVEL  (configuration as JSON on "
              "stdin)", file=sys.stderr)
        return 2
    try:
        config = load_config(CHILD.config_class, overrides=json.loads(sys.stdin.read()))
    except (ConfigError, ValueError) as err:
        print(f"replica process: bad configuration: {err}", file=sys.stderr)
        return 2
    logs.configure(f"replica-agent/{config.replicas[0].replica_id}" if config.replicas else "replica-process",
                   level=args[1], fmt=os.environ.get(logs.FORMAT_VARIABLE) or "text")
    event_loop.run(_run(config, int(args[0])), os.environ)   # as every server process (the agent's choice of loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
