"""Real etcd for the tests: one member or a cluster, on loopback ports, in a temporary directory.

Uses Debian's ``etcd`` (``etcd-server``, installed by ``scripts/install``); the
tests that need it are skipped where it is missing. Every member is stopped
(and killed if it does not stop) when the context ends.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(ETCD is None, reason="etcd is not installed (apt package etcd-server)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None
    tls: dict[str, str] | None = None
    """The server's {cert, key, ca}: clients speak https and must show a certificate of that CA."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls["ca"])
            context.load_cert_chain(self.tls["cert"], self.tls["key"])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),   # never through a proxy
                                             urllib.request.HTTPSHandler(context=context))
        try:
            with opener.open(f"{'https' if self.tls else 'http'}://{self.address}/health", timeout=1) as reply:
                return b'"true"' in reply.read()
        except OSError:
            return False


@dataclass
class EtcdCluster:
    members: list[Member]
    token: str
    extra: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        """``HOST:PORT,HOST:PORT...`` of every member (a ``store: etcd://...`` netloc)."""
        return ",".join(m.address for m in self.members)

    def url(self, prefix: str = "/rollmesh") -> str:
        return f"etcd://{self.endpoints}{prefix}"

    def start(self, member: Member, *, state: str = "new") -> None:
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        scheme = "https" if member.tls else "http"
        secure = [] if member.tls is None else [
            "--cert-file", member.tls["cert"], "--key-file", member.tls["key"],
            "--trusted-ca-file", member.tls["ca"], "--client-cert-auth"]
        log = member.log_path.open("ab")
        member.process = subprocess.Popen(
            [ETCD, "--name", member.name, "--data-dir", str(member.data_dir), *secure,
             "--listen-client-urls", f"{scheme}://127.0.0.1:{member.client_port}",
             "--advertise-client-urls", f"{scheme}://127.0.0.1:{member.client_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{member.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{member.peer_port}",
             "--initial-cluster", initial, "--initial-cluster-token", self.token,
             "--initial-cluster-state", state, "--heartbeat-interval", "50", "--election-timeout", "500",
             *self.extra],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def stop(self, member: Member, *, kill: bool = False) -> None:
        if member.process is None:
            return
        (member.process.kill if kill else member.process.terminate)()
        try:
            member.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            member.process.kill()
            member.process.wait(timeout=10)
        member.process = None

    def wait_healthy(self, members: list[Member] | None = None, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(members if members is not None else self.members)
        while waiting:
            waiting = [m for m in waiting if not m.healthy()]
            if not waiting:
                return
            for member in waiting:
                if member.process is not None and member.process.poll() is not None:
                    raise RuntimeError(f"etcd member {member.name} exited:\n{member.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd members {[m.name for m in waiting]} not healthy after {timeout_s:g} s")
            time.sleep(0.1)


@contextlib.contextmanager
def etcd_cluster(tmp: Path, size: int = 1, tls: dict[str, str] | None = None) -> Iterator[EtcdCluster]:
    """``size`` etcd members on loopback, healthy when yielded; all stopped after. ``tls`` ({cert, key, ca}
    of the members): https with client-certificate authentication against that CA."""
    if ETCD is None:
        pytest.skip("etcd is not installed (apt package etcd-server)")
    tmp.mkdir(parents=True, exist_ok=True)
    members = [Member(f"m{i}", _free_port(), _free_port(), tmp / f"m{i}.etcd", tmp / f"m{i}.log", tls=tls)
               for i in range(size)]
    cluster = EtcdCluster(members, token=f"rollmesh-test-{tmp.name}")
    try:
        for member in members:
            cluster.start(member)
        cluster.wait_healthy()
        yield cluster
    finally:
        for member in members:
            cluster.stop(member, kill=True)
