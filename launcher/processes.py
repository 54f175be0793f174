"""Start rollmesh servers as child processes and wait until each is listening.

Used by ``rollmesh up`` (and later the main job) and by end-to-end tests: a
child is ready when it prints ``rollmesh <server> listening on HOST:PORT``.
Stopping sends SIGTERM, waits for the grace period, then kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

READY_LINE = re.compile(r"^rollmesh (?P<server>[a-z-]+) listening on (?P<address>\S+)$")


class LaunchError(RuntimeError):
    """A child server exited or stayed silent instead of becoming ready."""


@dataclass
class ServerProcess:
    """A running child server and the address it announced."""

    name: str
    process: asyncio.subprocess.Process
    address: str
    log_path: Path | None = None
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def terminate(self, grace_s: float = 15.0) -> int:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout=grace_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        return await self.process.wait()   # the exit code (at once: it has ended)

    async def kill(self) -> None:
        """Kill without a chance to clean up (for crash tests)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


def server_command(server: str, args: Sequence[str] = ()) -> list[str]:
    """The command line that runs ``rollmesh <server>`` with this interpreter."""
    return [sys.executable, "-m", "launcher.cli", server, *args]


async def start_server(server: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
                       log_path: Path | None = None, ready_timeout_s: float = 60.0,
                       cwd: str | Path | None = None, prefix: Sequence[str] = ()) -> ServerProcess:
    """Launch ``rollmesh <server> ARGS`` and return once it announced readiness.

    stderr goes to ``log_path`` (or is inherited). ``prefix`` is a command the
    server runs under (``ip netns exec NS``, ``taskset -c 2``). Raises
    :class:`LaunchError` with the child's last output if it exits or times out
    first.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    stderr_file = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix, *server_command(server, args), stdout=asyncio.subprocess.PIPE,
            stderr=stderr_file if stderr_file else None, env=child_env, cwd=cwd,
            start_new_session=True)
    finally:
        if stderr_file:
            stderr_file.close()
    lines: list[str] = []

    async def wait_ready() -> str:
        assert proc.stdout is not None
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                code = await proc.wait()
                tail = _tail(log_path)
                raise LaunchError(f"rollmesh {server} exited with code {code} before it was ready"
                                  + (f"; last log lines:\n{tail}" if tail else ""))
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            match = READY_LINE.match(line)
            if match and match.group("server") == server:
                return match.group("address")

    try:
        address = await asyncio.wait_for(wait_ready(), timeout=ready_timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise LaunchError(f"rollmesh {server} did not become ready within {ready_timeout_s:.0f} s") from None
    except asyncio.CancelledError:   # whoever waited gave up: the child must not outlive the start
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    handle = ServerProcess(server, proc, address, log_path, lines)
    asyncio.get_running_loop().create_task(_drain(proc, lines))
    return handle


async def _drain(proc: asyncio.subprocess.Process, lines: list[str]) -> None:
    """Keep reading the child's stdout so it never blocks on a full pipe."""
    if proc.stdout is None:
        return
    with contextlib.suppress(Exception):
        async for raw in proc.stdout:
            lines.append(raw.decode(errors="replace").rstrip("\n"))


def _tail(path: Path | None, n: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
