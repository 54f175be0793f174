"""``rollmesh up``: start the four servers locally and print their status (a tool subcommand)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "start the four servers locally and print their status"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", default="runs/up", help="directory for the servers' logs")
    parser.add_argument("--config", metavar="FILE", help="serve a model for agents (examples/serve.yaml): a "
                        "balancer with the OpenAI-compatible API, a controller and a replica agent; prints "
                        "the API's base URL on a line 'openai: URL'")
    parser.add_argument("--exit-after-status", action="store_true",
                        help="stop the servers after printing their status instead of waiting for Ctrl-C")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    from .local_mesh import up  # noqa: PLC0415

    return asyncio.run(up(args.run_dir, exit_after_status=args.exit_after_status, env=env, config=args.config))
