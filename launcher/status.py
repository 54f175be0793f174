"""``rollmesh status ADDRESS``: print a running server's status (a tool subcommand)."""

from __future__ import annotations

import argparse
import asyncio

HELP = "print the status of a running server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    from .local_mesh import print_status  # noqa: PLC0415

    return asyncio.run(print_status(args.address, timeout_s=args.timeout))
