"""Synchronous helpers to run rollmesh servers as processes from (module-scoped) fixtures."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from launcher.processes import READY_LINE, server_command


def free_port() -> int:
    """A loopback port free now (for a server that must be restarted at the same address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without OTEL_/ROLLMESH_ settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "ROLLMESH_"))}
    env.update(extra)
    return env


@contextlib.contextmanager
def running_server(name: str, args: list[str], *, log_path: Path, env: dict[str, str] | None = None,
                   ready_timeout_s: float = 90.0, prefix: list[str] | None = None, python: str | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``rollmesh NAME ARGS`` (under the command ``prefix``; with the interpreter ``python``, default this
    one); yield ``(address, process)``; SIGTERM it afterwards."""
    command = server_command(name, args) if python is None else [python, "-m", "launcher.cli", name, *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*(prefix or []), *command], stdout=subprocess.PIPE, stderr=log,
                                env=env if env is not None else clean_env(), start_new_session=True)
    try:
        address = _await_ready(proc, name, ready_timeout_s, log_path)
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _await_ready(proc: subprocess.Popen, name: str, timeout_s: float, log_path: Path) -> str:
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline().decode(errors="replace").strip()
        if not line:
            proc.wait(timeout=10)
            raise RuntimeError(f"rollmesh {name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        match = READY_LINE.match(line)
        if match and match.group("server") == name:
            return match.group("address")
    proc.kill()
    raise RuntimeError(f"rollmesh {name} not ready within {timeout_s} s:\n{log_path.read_text()[-3000:]}")
