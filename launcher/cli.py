"""The ``rollmesh`` command: one subcommand per server, plus the tools.

``rollmesh controller|lb|replica-agent|trainer-agent [--config FILE] [--listen HOST:PORT]``
runs one server in this process. A bad flag or config value exits with code 2
and one line that names the bad key and why. Tools (``train``, ``up``,
``status``, ``simulate``, ``top``) are modules found by name and imported only
when their subcommand runs, so ``rollmesh lb --help`` loads no other server and
no tool. It lives in the launcher, the one package above the servers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from mesh_runtime import event_loop, logs
from mesh_runtime.config import ConfigError, config_notes, describe, load_config
from mesh_runtime.logs import FORMAT_VARIABLE, FORMATS

# Subcommand -> module exposing CONFIG_CLASS, ENV_PREFIX and `async serve(config, env)`.
SERVERS = {
    "controller": "controller.server",
    "lb": "loadbalancer.server",
    "replica-agent": "replica_agent.server",
    "trainer-agent": "trainer_agent.server",
}

# Tool subcommand -> module exposing `HELP`, `add_arguments(parser)` and
# `run(args, env) -> int` (the exit code). Each module is imported only when
# its subcommand runs, except to build its arguments.
TOOLS = {
    "train": "launcher.train",
    "up": "launcher.up",
    "status": "launcher.status",
    "simulate": "simulator.cli",
    "top": "launcher.top",
    "certs": "mesh_runtime.certs",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# Flags that set one config key each (the reference's flag names), per server:
# flag -> (config key, metavar, help). They win over the file and the environment.
KEY_FLAGS: dict[str, dict[str, tuple[str, str, str]]] = {
    "lb": {
        "--workers": ("workers", "N", "balancer processes on this host, each registered with the controller"),
        "--http-listen": ("http_listen", "HOST:PORT", "serve the OpenAI-compatible HTTP API here (needs model)"),
    },
    "controller": {
        "--autoscaler-config": ("autoscaler_config", "FILE", "autoscaler YAML; the autoscaler is off without it"),
        "--store": ("store", "URL", "where the state lives: sqlite:///PATH or etcd://HOST:PORT[,HOST:PORT...]/PREFIX"),
        "--scale-out-timeout": ("scale_out_timeout", "SECONDS", "default timeout of a scale-out (1800)"),
        "--scale-out-partial-success-policy": ("scale_out_partial_success_policy", "POLICY",
                                               "rollback_all (default) or keep_partial"),
        "--scale-in-drain-timeout": ("scale_in_drain_timeout", "SECONDS",
                                     "wait for in-flight requests before aborting them (30)"),
        "--scale-in-shutdown-timeout": ("scale_in_shutdown_timeout", "SECONDS",
                                        "wait for a removed replica to stop before forcing it (20)"),
    },
}


def _server_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help=f"run the {name} server", description=f"Run the rollmesh {name} server.")
    p.add_argument("--config", metavar="FILE", help="YAML config file (keys documented by --print-default-config)")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve on; port 0 picks a free port")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", choices=FORMATS, default=None,
                   help=f"text (default) or json lines with trace_id/span_id (or set {FORMAT_VARIABLE})")
    p.add_argument("--insecure", action="store_true",
                   help="serve plaintext on a non-loopback listen address (config key insecure); "
                        "without tls such an address is refused")
    p.add_argument("--print-default-config", action="store_true",
                   help="print every config key with its default and meaning, then exit")
    for flag, (key, metavar, text) in KEY_FLAGS.get(name, {}).items():
        p.add_argument(flag, dest=f"key_{key}", metavar=metavar, help=f"{text} (config key {key})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rollmesh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SERVERS:
        _server_parser(sub, name)
    for name, module_name in TOOLS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise
            continue  # that tool is not part of this installation
        tool = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(tool)
    return parser


def _scalar(text: str) -> Any:
    """A flag's value read as a YAML scalar (``5`` is a number), as environment overrides are."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (int, float, str, bool)) else text


def server_config(name: str, args: argparse.Namespace, env: dict[str, str]) -> Any:
    """The server's config from its file, the environment and its flags; ConfigError names a bad key."""
    module = importlib.import_module(SERVERS[name])
    overrides: dict[str, Any] = {"listen": args.listen} if args.listen is not None else {}
    if args.insecure:
        overrides["insecure"] = True
    for key, _, _ in KEY_FLAGS.get(name, {}).values():
        if (value := getattr(args, f"key_{key}")) is not None:
            overrides[key] = _scalar(value)
    return load_config(module.CONFIG_CLASS, args.config, env=env, env_prefix=module.ENV_PREFIX, overrides=overrides)


def print_config_notes(name: str, config: Any, stream: Any = None) -> None:
    """One line per config section about keys accepted without effect here (verl's ``async_training`` keys)."""
    for note in config_notes(config):
        print(f"rollmesh {name}: {note}", file=stream or sys.stderr, flush=True)


def run_server(name: str, args: argparse.Namespace, env: dict[str, str]) -> int:
    module = importlib.import_module(SERVERS[name])
    if args.print_default_config:
        print(describe(module.CONFIG_CLASS))
        return 0
    try:
        config = server_config(name, args, env)
    except ConfigError as err:
        print(f"rollmesh {name}: error: {err}", file=sys.stderr)
        return 2
    log_format = args.log_format or env.get(FORMAT_VARIABLE, "") or "text"
    if log_format not in FORMATS:
        print(f"rollmesh {name}: error: {FORMAT_VARIABLE} must be one of {', '.join(FORMATS)}, "
              f"got {log_format[:20]!r}", file=sys.stderr)
        return 2
    try:
        event_loop.loop_choice(env)
    except ValueError as err:
        print(f"rollmesh {name}: error: {err}", file=sys.stderr)
        return 2
    logs.configure(name, level=args.log_level, fmt=log_format)
    print_config_notes(name, config)
    from mesh_runtime.errors import RollmeshError  # noqa: PLC0415
    from mesh_runtime.server import PortInUse  # noqa: PLC0415

    try:
        event_loop.run(module.serve(config, env), env)
    except PortInUse as err:  # a usage error, like a bad flag: exit 2 naming the address
        print(f"rollmesh {name}: error: {err}", file=sys.stderr)
        return 2
    except RollmeshError as err:   # a refusal to start that says why (a state store of a newer release, ...)
        print(f"rollmesh {name}: error: {err.message}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"rollmesh {name}: error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)  # read once, passed down explicitly
    if args.command in SERVERS:
        return run_server(args.command, args, env)
    if args.command in TOOLS:
        return importlib.import_module(TOOLS[args.command]).run(args, env)
    return 2


if __name__ == "__main__":
    sys.exit(main())
