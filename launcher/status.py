"""``rollmesh status HOST[:PORT]``: print a running server's status (a tool subcommand).

A readable summary by default (identity, readiness, transport, uptime, what it
holds); ``--json`` prints the whole ``GetStatus`` answer, integers as integers.
Given the controllers of one store (``HOST:PORT,HOST:PORT,...``), it asks each
and prints the leader's status, then a line for every other one (a standby and
the leader it names, or why it did not answer); ``--json`` then prints every
answer by address. It fails when no listed controller answers as the leader.
"""

from __future__ import annotations

import argparse
import asyncio

from mesh_runtime.config import ConfigError
from mesh_runtime.tls import add_client_arguments, client_tls

HELP = "print the status of a running server"


DEFAULT_PORT = 50051
"""The port of a bare host: the controller's default listen port."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST[:PORT][,HOST[:PORT]...]",
                        help=f"a server, or the controllers of one store; a bare host means port {DEFAULT_PORT} "
                             "(the controller's default)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    parser.add_argument("--json", action="store_true", help="print the whole GetStatus answer as JSON")
    add_client_arguments(parser)


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    import sys  # noqa: PLC0415

    from mesh_runtime.channels import address_list  # noqa: PLC0415

    from .local_mesh import print_leader_status, print_status  # noqa: PLC0415

    try:
        tls = client_tls(args)
        given = address_list(args.address) or [args.address]
        addresses = [with_default_port(address) for address in given]
    except (ConfigError, ValueError) as err:
        print(f"rollmesh status: error: {err}", file=sys.stderr)
        return 2
    for bare, address in zip(given, addresses):
        if address != bare:
            print(f"rollmesh status: no port given; using {address} (the controller's default port)",
                  file=sys.stderr)
    if len(addresses) > 1:
        return asyncio.run(print_leader_status(addresses, timeout_s=args.timeout, tls=tls, as_json=args.json))
    return asyncio.run(print_status(addresses[0], timeout_s=args.timeout, tls=tls, as_json=args.json))


def with_default_port(address: str) -> str:
    """``address`` with :data:`DEFAULT_PORT` when it names a host only; ValueError when it is no address."""
    from mesh_runtime.net import AddressError, parse_host_port  # noqa: PLC0415

    text = address.strip()
    bare = ":" not in text or (text.startswith("[") and text.endswith("]"))
    candidate = f"{text}:{DEFAULT_PORT}" if bare and text else text
    try:
        parse_host_port(candidate, allow_zero_port=False)
    except AddressError as err:
        raise ValueError(f"address: {err}") from None
    return candidate
