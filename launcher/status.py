"""``rollmesh status ADDRESS``: print a running server's status (a tool subcommand)."""

from __future__ import annotations

import argparse
import asyncio

from mesh_runtime.config import ConfigError
from mesh_runtime.tls import add_client_arguments, client_tls

HELP = "print the status of a running server"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    add_client_arguments(parser)


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    import sys  # noqa: PLC0415

    from .local_mesh import print_status  # noqa: PLC0415

    try:
        tls = client_tls(args)
    except ConfigError as err:
        print(f"rollmesh status: error: {err}", file=sys.stderr)
        return 2
    return asyncio.run(print_status(args.address, timeout_s=args.timeout, tls=tls))
