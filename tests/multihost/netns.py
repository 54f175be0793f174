"""Hosts as Linux network namespaces on one private bridge, with pairwise partitions.

Each host is a namespace with one interface ``eth0`` (a veth pair whose other
end sits on a bridge in a hub namespace) and one address of ``10.77.0.0/24``;
nothing is added to the namespace the tests run in. A partition between two
hosts is a blackhole route to each other on both sides: packets between them
are dropped at once, every other pair still talks. A slow, lossy link is a
rate limit with a short queue on the bridge port (:meth:`Network.shape`). Needs root (CAP_NET_ADMIN)
and the ``ip`` command; :func:`unavailable` says why it cannot run where it
cannot.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

SUBNET = "10.77.0"
EPHEMERAL_PORTS = (40000, 40999)


def _run(ns: str | None, *command: str) -> None:
    """Run ``command`` in namespace ``ns`` (here when None); RuntimeError with its stderr if it fails."""
    command = ("ip", "netns", "exec", ns, *command) if ns else command
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def _ip(*args: str, ns: str | None = None) -> None:
    _run(ns, "ip", *args)


def _ip_tc(ns: str, *args: str) -> None:
    _run(ns, "tc", *args)


def unavailable() -> str:
    """Why namespaces cannot be made here ('' when they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"rmprobe{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"this kernel or user may not create network namespaces: {done.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return ""


class Network:
    """``hosts`` as namespaces on one bridge; :meth:`close` removes everything."""

    def __init__(self, hosts: Sequence[str], ephemeral_ports: tuple[int, int] = EPHEMERAL_PORTS) -> None:
        self.ephemeral_ports = ephemeral_ports
        self.tag = secrets.token_hex(2)
        self.hub = f"rm{self.tag}-hub"
        self.hosts = list(hosts)
        self.namespaces = {h: f"rm{self.tag}-{h}" for h in self.hosts}
        self.addresses = {h: f"{SUBNET}.{i + 2}" for i, h in enumerate(self.hosts)}
        self._made: list[str] = []
        self._cuts: set[frozenset[str]] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.hub, *self.namespaces.values()):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
            self._made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.hub)
        _ip("link", "set", "br0", "up", ns=self.hub)
        for index, host in enumerate(self.hosts):
            ns, port = self.namespaces[host], f"p{index}"
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
            _ip("link", "set", port, "master", "br0", ns=self.hub)
            _ip("link", "set", port, "up", ns=self.hub)
            _ip("addr", "add", f"{self.addresses[host]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            # the ports bind(0) and outgoing connections take (gloo's and NCCL's among them): a firewall range
            low, high = self.ephemeral_ports
            _run(ns, "sysctl", "-q", "-w", f"net.ipv4.ip_local_port_range={low} {high}")

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b`` (both directions); other pairs are unaffected."""
        for src, dst in ((a, b), (b, a)):
            _ip("route", "add", "blackhole", f"{self.addresses[dst]}/32", ns=self.namespaces[src])
        self._cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            _ip("route", "del", "blackhole", f"{self.addresses[dst]}/32", ns=self.namespaces[src])
        self._cuts.discard(frozenset((a, b)))

    def shape(self, src: str, dst: str, *, rate: str, queue_packets: int) -> None:
        """Make the link from ``src`` to ``dst`` slow and lossy: packets from ``src`` into ``dst`` go through
        a ``rate`` limit (htb) with a ``queue_packets``-long queue (pfifo) that drops what overflows, so
        bursts are delayed and lost (this kernel has no netem). Only that direction of that pair."""
        port = f"p{self.hosts.index(dst)}"
        _ip_tc(self.hub, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "10", "r2q", "1000")
        _ip_tc(self.hub, "class", "add", "dev", port, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
        _ip_tc(self.hub, "class", "add", "dev", port, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
               "ceil", rate)
        _ip_tc(self.hub, "qdisc", "add", "dev", port, "parent", "1:20", "handle", "20:", "pfifo", "limit",
               str(queue_packets))
        _ip_tc(self.hub, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "u32", "match", "ip",
               "src", f"{self.addresses[src]}/32", "flowid", "1:20")

    def unshape(self, dst: str) -> None:
        _ip_tc(self.hub, "qdisc", "del", "dev", f"p{self.hosts.index(dst)}", "root")

    def connections(self, host: str) -> list[tuple[int, str, int]]:
        """(local port, peer address, peer port) of ``host``'s TCP connections on the bridge now."""
        done = subprocess.run([*self.prefix(host), "ss", "-tnH"], capture_output=True, text=True, timeout=30)
        out = []
        for line in done.stdout.splitlines():
            fields = [f.replace("[::ffff:", "").replace("]", "") for f in line.split()]   # IPv4 on a dual-stack socket
            if len(fields) >= 5 and fields[4].startswith(SUBNET + "."):
                local, peer = fields[3].rsplit(":", 1), fields[4].rsplit(":", 1)
                out.append((int(local[1]), peer[0], int(peer[1])))
        return out

    def close(self) -> None:
        """Stop every process still inside the namespaces, then delete them. A job killed at its timeout
        cannot stop the servers it started in other namespaces, and deleting a namespace does not end the
        processes in it: without this they would outlive the test."""
        for ns in reversed(self._made):
            for _ in range(3):   # a dying process's children may appear in the list once more
                listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
                pids = [int(p) for p in listed.stdout.split() if p.isdigit()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def describe(self) -> dict:
        """What a process in another namespace needs to use this network (JSON-able)."""
        return {"tag": self.tag, "hub": self.hub, "namespaces": self.namespaces, "addresses": self.addresses,
                "ephemeral_ports": list(self.ephemeral_ports)}

    @classmethod
    def attach(cls, described: dict) -> Network:
        """The network :meth:`describe` described, made by another process (closing it is theirs)."""
        network = cls.__new__(cls)
        network.tag, network.hub = described["tag"], described["hub"]
        network.namespaces, network.addresses = dict(described["namespaces"]), dict(described["addresses"])
        network.ephemeral_ports = tuple(described["ephemeral_ports"])
        network.hosts = list(network.namespaces)
        network._made, network._cuts = [], set()
        return network
