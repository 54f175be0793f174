"""rollmesh's balancer side by side with SMG (the Rust SGLang/Shepherd Model Gateway), in one run.

Both route 4 workers that give each request the same token rate: SMG 1.13.0 routes 4 fake SGLang workers
(:mod:`benchmarks.fake_sglang_worker`, streaming a server-sent event per 16 tokens), ``rollmesh lb`` routes 4
replica agents of one synthetic replica each (default stream settings). The same client shapes go to each
router and, for the baseline, straight to the workers. Printed per system:

1. short requests (16 prompt tokens, 16 out, 128 concurrent): requests/s via the router and direct, and the
   router's CPU per request;
2. streaming (256-token responses at ``--rate`` tokens/s, 256 concurrent): the router's CPU per 1,000
   streamed tokens, and throughput via the router over direct (rollmesh: also the agents' CPU, and the same
   run with ``final_only``);
3. one of the 4 workers SIGKILLed when half of ``--kill-requests`` streaming requests have completed: how
   many requests failed.

The same HTTP client code (keep-alive, SGLang's ``/generate``) runs against SMG and against rollmesh's balancer
with its HTTP front on (column "rollmesh /generate"): like with like. rollmesh's own clients are measured too
(column "rollmesh gRPC": a ``Generate`` call per request). rollmesh is also measured as its trainer's rollouter calls it: every request on the balancer's
``GenerateMany`` stream (:class:`mesh_runtime.generate_many.BalancerGenerations`), for short requests,
streamed and final-only responses, and the kill.

SMG is installed with pip into its own cached virtual environment (``~/.cache/rollmesh/bench/smg-1.13.0``),
a benchmark tool and not a dependency of rollmesh; it runs with ``--log-level warn`` (at its default, info, it
logs two lines per request). CPU is read from ``/proc`` (user + system time of the router process and its
children). Everything shares this machine's cores, clients included; the figures say how many it has.

    .venv/bin/python -m benchmarks.bench_vs_smg [--rate 200] [--short 2000] [--stream 768] [--kill-requests 1000]
        [--only smg|rollmesh|rollmesh-http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.bench_loadbalancer import pct
from benchmarks.cpu_quota import cpu_seconds
from launcher.processes import start_server
from mesh_runtime.channels import open_channel
from mesh_runtime.generate_many import BalancerGenerations
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc

SMG_VERSION = "1.13.0"
VENV = Path.home() / ".cache" / "rollmesh" / "bench" / f"smg-{SMG_VERSION}"
PROMPT = list(range(1, 17))
AGENT = """node_id: {node}
slots: 1
backend: synthetic
engine_options: {{tokens_per_second: {rate}, max_batch_size: 1024, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: {node}-0}}]
"""


def smg_binary() -> Path:
    """The smg launcher in its own virtual environment, installed on first use."""
    binary = VENV / "bin" / "smg"
    if not binary.exists():
        print(f"installing smg=={SMG_VERSION} into {VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "--quiet", f"smg=={SMG_VERSION}"], check=True)
    return binary


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live children."""
    total = cpu_seconds(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            try:
                total += tree_cpu(int(child))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return total


def kill_halfway(requests: int, kill: Callable[[], None]) -> Callable[[], None]:
    """A load's ``on_done``: calls ``kill`` once, when half of ``requests`` have completed."""
    done = 0

    def on_done() -> None:
        nonlocal done
        done += 1
        if done == requests // 2:
            kill()
    return on_done


def kill_first(agents: list, killed: list) -> None:
    """SIGKILL the first replica agent and note it (its process is not terminated again afterwards)."""
    os.kill(agents[0].pid, signal.SIGKILL)
    killed.append(agents[0])


# ---------------------------------------------------------------------------------------------- HTTP side

class HttpConnection:
    """One keep-alive HTTP/1.1 connection: POST /generate, read a JSON or server-sent-event answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def generate(self, max_tokens: int, stream: bool) -> int:
        """Tokens received; raises on an error status or a stream that ends before ``[DONE]``."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_tokens},
                           "stream": stream}).encode()
        self.writer.write(f"POST /generate HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n\r\n".encode() + body)
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1]
            headers = head.lower()
            if b"transfer-encoding: chunked" in headers:
                data = await self._chunked()
            else:
                length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                data = await self.reader.readexactly(length)
        except BaseException:
            self.writer.close()
            self.writer = None
            raise
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {data[:120]!r}")
        if not stream:
            return int(json.loads(data)["meta_info"]["completion_tokens"])
        events = [e for e in data.split(b"\n\n") if e.startswith(b"data: ")]
        if not events or events[-1] != b"data: [DONE]":
            raise RuntimeError("stream ended before [DONE]")
        last = json.loads(events[-2][6:]) if len(events) > 1 else {}
        if "meta_info" not in last:   # SMG reports a broken upstream stream as an error event
            raise RuntimeError(f"stream failed: {events[-2][:120]!r}" if len(events) > 1 else "empty stream")
        return int(last["meta_info"]["completion_tokens"])

    async def _chunked(self) -> bytes:
        assert self.reader is not None
        parts = []
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readexactly(2)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def http_load(addresses: list[tuple[str, int]], requests: int, concurrency: int, max_tokens: int,
                    stream: bool, on_done=None) -> tuple[float, list[float], int, int]:
    """(wall s, latencies, tokens, failures); worker task i talks to addresses[i % len]."""
    left = list(range(requests))
    latencies: list[float] = []
    tokens = failures = 0

    async def client(i: int) -> None:
        nonlocal tokens, failures
        conn = HttpConnection(*addresses[i % len(addresses)])
        try:
            while left:
                left.pop()
                start = time.perf_counter()
                try:
                    got = await conn.generate(max_tokens, stream)
                    tokens += got
                    latencies.append(time.perf_counter() - start)
                except (RuntimeError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
                    failures += 1
                if on_done is not None:
                    on_done()
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return time.perf_counter() - start, latencies, tokens, failures


async def start_workers(rate: float, count: int = 4) -> list[tuple[asyncio.subprocess.Process, int]]:
    workers = []
    for _ in range(count):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "benchmarks.fake_sglang_worker",
                                                    "--rate", str(rate), stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        line = (await proc.stdout.readline()).decode()
        workers.append((proc, int(line.split()[1])))
    return workers


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_smg(ports: list[int], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "round_robin", "--log-level", "warn",
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                             "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports]],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:   # ready once it routes a request
        try:
            conn = HttpConnection("127.0.0.1", port)
            await conn.generate(1, False)
            conn.close()
            return proc, port
        except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError, IndexError):
            await asyncio.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"smg did not start; see {log}")


async def smg_runs(args, tmp: Path) -> dict:
    out: dict = {}
    workers = await start_workers(args.rate)
    ports = [p for _, p in workers]
    direct = [("127.0.0.1", p) for p in ports]
    smg, port = await start_smg(ports, tmp / "smg.log")
    via = [("127.0.0.1", port)]
    try:
        await http_load(via, 200, 32, 16, False)   # warm
        wall_d, _, _, _ = await http_load(direct, args.short, 128, 16, False)
        cpu = tree_cpu(smg.pid)
        wall, lat, _, fail = await http_load(via, args.short, 128, 16, False)
        out["short"] = (args.short / wall, args.short / wall_d, (tree_cpu(smg.pid) - cpu) / args.short, fail,
                        pct(lat, 50))
        wall_d, _, _, _ = await http_load(direct, args.stream, 256, 256, True)
        cpu = tree_cpu(smg.pid)
        wall, lat, tokens, fail = await http_load(via, args.stream, 256, 256, True)
        out["stream"] = ((tree_cpu(smg.pid) - cpu) / tokens * 1000, wall_d / wall, fail, pct(lat, 50))
    finally:
        smg.terminate()
        smg.wait(10)
        for proc, _ in workers:
            proc.kill()
    # kill run: fresh workers and router
    workers = await start_workers(args.rate)
    smg, port = await start_smg([p for _, p in workers], tmp / "smg-kill.log")
    try:
        on_done = kill_halfway(args.kill_requests, lambda: workers[0][0].send_signal(signal.SIGKILL))
        _, _, _, fail = await http_load([("127.0.0.1", port)], args.kill_requests, 256, 256, True, on_done)
        out["kill"] = fail
    finally:
        smg.terminate()
        smg.wait(10)
        for proc, _ in workers:
            if proc.returncode is None:
                proc.kill()
    return out


# ------------------------------------------------------------------------------------------- rollmesh side

async def start_mesh(tmp: Path, rate: float, http_port: int | None = None):
    """4 replica agents and a balancer routing them (with ``http_port``: its HTTP front on, SGLang's API)."""
    agents = []
    for i in range(4):
        node = f"n{i}"
        (tmp / f"{node}.yaml").write_text(AGENT.format(node=node, rate=rate))
        agents.append(await start_server("replica-agent", ["--config", str(tmp / f"{node}.yaml"),
                                                           "--listen", "127.0.0.1:0"], log_path=tmp / f"{node}.log"))
    (tmp / "lb.yaml").write_text(f"http_listen: 127.0.0.1:{http_port}\nmodel: tiny-llama\nhttp_max_in_flight: 100000\n"
                                 if http_port else "{}\n")
    lb = await start_server("lb", ["--config", str(tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "lb.log")
    replicas = [(f"n{i}-0", a.address) for i, a in enumerate(agents)]
    async with open_channel(lb.address) as ch:
        await loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).AddReplicas(loadbalancer_pb2.AddReplicasRequest(
            replicas=[routing_pb2.ReplicaEndpoint(replica_id=r, address=a) for r, a in replicas]))
    return lb, agents, replicas


async def grpc_load(lb_address: str | None, replicas, requests: int, concurrency: int, max_tokens: int,
                    tag: str, *, final_only: bool = False, many: bool = False,
                    on_done=None) -> tuple[float, list[float], int, int]:
    """(wall s, latencies, tokens, failures) through the balancer, or straight to the agents (round robin).
    ``many``: the client sends its requests on the balancer's GenerateMany stream, as the trainer's
    rollouter does (:class:`mesh_runtime.generate_many.BalancerGenerations`)."""
    channels = {a: open_channel(a) for a in ({lb_address} if lb_address else {a for _, a in replicas})}
    generations = None
    if many and lb_address:
        generations = BalancerGenerations(channels[lb_address])
        await generations.check()
    left = list(range(requests))
    latencies: list[float] = []
    tokens = failures = 0
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def client(worker: int) -> None:
        nonlocal tokens, failures
        while left:
            i = left.pop()
            start = time.perf_counter()
            try:
                if lb_address:
                    request = loadbalancer_pb2.GenerateRequest(
                        request_id=f"{tag}-{i}", prompt_token_ids=PROMPT, sampling_params=sampling,
                        final_only=final_only)
                    if generations is not None:
                        call = generations.call(request, timeout_s=600)
                    else:
                        call = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channels[lb_address]).Generate(
                            request, timeout=600)
                    got = 0
                    async for msg in call:
                        got = msg.usage.completion_tokens if msg.finish_reason else got
                else:
                    replica_id, address = replicas[worker % len(replicas)]
                    stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channels[address])
                    got = 0
                    async for msg in stub.Generate(replica_agent_pb2.GenerateRequest(
                            replica_id=replica_id, request_id=f"{tag}-{i}", prompt_token_ids=PROMPT,
                            sampling_params=sampling), timeout=600):
                        got = msg.usage.completion_tokens if msg.finish_reason else got
                if got != max_tokens:
                    raise RuntimeError(f"{got} tokens")
                tokens += got
                latencies.append(time.perf_counter() - start)
            except Exception:  # noqa: BLE001 - counted
                failures += 1
            if on_done is not None:
                on_done()

    start = time.perf_counter()
    try:
        await asyncio.gather(*(client(w) for w in range(concurrency)))
    finally:
        if generations is not None:
            await generations.close()
        for ch in channels.values():
            await ch.close()
    return time.perf_counter() - start, latencies, tokens, failures


async def rollmesh_runs(args, tmp: Path) -> dict:
    out: dict = {}
    lb, agents, replicas = await start_mesh(tmp, args.rate)
    try:
        await grpc_load(lb.address, replicas, 200, 32, 16, "warm")
        wall_d, _, _, _ = await grpc_load(None, replicas, args.short, 128, 16, "sd")
        cpu, agent_cpu = cpu_seconds(lb.pid), sum(cpu_seconds(a.pid) for a in agents)
        wall, lat, _, fail = await grpc_load(lb.address, replicas, args.short, 128, 16, "s")
        out["short"] = (args.short / wall, args.short / wall_d, (cpu_seconds(lb.pid) - cpu) / args.short, fail,
                        pct(lat, 50))
        out["agent_short"] = (sum(cpu_seconds(a.pid) for a in agents) - agent_cpu) / args.short
        cpu = cpu_seconds(lb.pid)
        wall, lat, _, fail = await grpc_load(lb.address, replicas, args.short, 128, 16, "sm", many=True)
        out["short_many"] = (args.short / wall, (cpu_seconds(lb.pid) - cpu) / args.short, fail, pct(lat, 50))
        wall_d, _, _, _ = await grpc_load(None, replicas, args.stream, 256, 256, "d")
        for mode, final_only, many in (("stream", False, False), ("final", True, False),
                                       ("many_stream", False, True), ("many", True, True)):
            cpu, agent_cpu = cpu_seconds(lb.pid), sum(cpu_seconds(a.pid) for a in agents)
            wall, lat, tokens, fail = await grpc_load(lb.address, replicas, args.stream, 256, 256, mode,
                                                      final_only=final_only, many=many)
            out[mode] = ((cpu_seconds(lb.pid) - cpu) / tokens * 1000, wall_d / wall, fail, pct(lat, 50))
            out[f"agent_{mode}"] = (sum(cpu_seconds(a.pid) for a in agents) - agent_cpu) / tokens * 1000
    finally:
        await asyncio.gather(*(p.terminate() for p in (lb, *agents)))
    for key, many in (("kill", False), ("kill_many", True)):   # per-call clients, then GenerateMany clients
        lb, agents, replicas = await start_mesh(tmp, args.rate)
        try:
            killed: list = []
            on_done = kill_halfway(args.kill_requests, lambda: kill_first(agents, killed))
            _, _, _, fail = await grpc_load(lb.address, replicas, args.kill_requests, 256, 256, key, many=many,
                                            on_done=on_done)
            out[key] = fail
        finally:
            await asyncio.gather(*(p.terminate() for p in (lb, *agents) if p not in killed))
    return out


async def rollmesh_http_runs(args, tmp: Path) -> dict:
    """rollmesh's balancer through SGLang's /generate on its HTTP front: the client code of the SMG runs."""
    out: dict = {}
    port = free_port()
    lb, agents, replicas = await start_mesh(tmp, args.rate, port)
    via = [("127.0.0.1", port)]
    try:
        await http_load(via, 200, 32, 16, False)   # warm
        wall_d, _, _, _ = await grpc_load(None, replicas, args.short, 128, 16, "hsd")
        cpu, agent_cpu = cpu_seconds(lb.pid), sum(cpu_seconds(a.pid) for a in agents)
        wall, lat, _, fail = await http_load(via, args.short, 128, 16, False)
        out["short"] = (args.short / wall, args.short / wall_d, (cpu_seconds(lb.pid) - cpu) / args.short, fail,
                        pct(lat, 50))
        out["agent_short"] = (sum(cpu_seconds(a.pid) for a in agents) - agent_cpu) / args.short
        wall_d, _, _, _ = await grpc_load(None, replicas, args.stream, 256, 256, "hd")
        cpu, agent_cpu = cpu_seconds(lb.pid), sum(cpu_seconds(a.pid) for a in agents)
        wall, lat, tokens, fail = await http_load(via, args.stream, 256, 256, True)
        out["stream"] = ((cpu_seconds(lb.pid) - cpu) / max(tokens, 1) * 1000, wall_d / wall, fail, pct(lat, 50))
        out["agent_stream"] = (sum(cpu_seconds(a.pid) for a in agents) - agent_cpu) / max(tokens, 1) * 1000
    finally:
        await asyncio.gather(*(p.terminate() for p in (lb, *agents)))
    port = free_port()
    lb, agents, replicas = await start_mesh(tmp, args.rate, port)
    killed = []
    try:
        on_done = kill_halfway(args.kill_requests, lambda: kill_first(agents, killed))
        _, _, _, fail = await http_load([("127.0.0.1", port)], args.kill_requests, 256, 256, True, on_done)
        out["kill"] = fail
    finally:
        await asyncio.gather(*(p.terminate() for p in (lb, *agents) if p not in killed))
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="tokens/s per request of every worker")
    parser.add_argument("--short", type=int, default=2000, help="short requests per run")
    parser.add_argument("--stream", type=int, default=768, help="streaming requests per run")
    parser.add_argument("--kill-requests", type=int, default=1000)
    parser.add_argument("--only", choices=("smg", "rollmesh", "rollmesh-http"), help="run one system only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        smg = await smg_runs(args, tmp) if args.only != "rollmesh" else None
        mesh = await rollmesh_runs(args, tmp) if args.only not in ("smg", "rollmesh-http") else None
        http = await rollmesh_http_runs(args, tmp) if args.only not in ("smg", "rollmesh") else None
    print(f"\nrollmesh lb vs SMG {SMG_VERSION}: 4 workers at {args.rate:g} tokens/s per request, "
          f"{os.cpu_count()} cores shared by everything")
    rows = [
        ("short requests/s via router (direct)", lambda r: f"{r['short'][0]:7.1f} ({r['short'][1]:.1f})"),
        ("router CPU per short request", lambda r: f"{r['short'][2] * 1e3:6.3f} ms"),
        ("short request p50", lambda r: f"{r['short'][4] * 1e3:6.1f} ms"),
        ("router CPU per 1,000 streamed tokens", lambda r: f"{r['stream'][0] * 1e3:6.2f} ms"),
        ("streaming throughput vs direct", lambda r: f"{r['stream'][1]:6.3f}x"),
        ("failed of the streaming requests", lambda r: f"{r['stream'][2]}"),
        (f"failed with a worker SIGKILLed ({args.kill_requests} streams)", lambda r: f"{r['kill']}"),
    ]
    print(f"  {'':52} {'SMG':>18} {'rollmesh /generate':>18} {'rollmesh gRPC':>18}")
    for name, cell in rows:
        print(f"  {name:52} {cell(smg) if smg else '-':>18} {cell(http) if http else '-':>18} "
              f"{cell(mesh) if mesh else '-':>18}")
    if http:
        print(f"  rollmesh /generate: the SMG column's client code against the balancer's HTTP front; agents' CPU "
              f"per short request {http['agent_short'] * 1e3:.3f} ms, per 1,000 streamed tokens "
              f"{http['agent_stream'] * 1e3:.2f} ms")
    if mesh:
        print(f"  rollmesh, final_only callers: balancer CPU per 1,000 tokens {mesh['final'][0] * 1e3:.2f} ms, "
              f"throughput vs direct {mesh['final'][1]:.3f}x")
        print(f"  rollmesh, clients on GenerateMany (as the trainer's rollouter): {mesh['short_many'][0]:.1f} short "
              f"req/s, balancer CPU {mesh['short_many'][1] * 1e3:.3f} ms per short request; per 1,000 tokens "
              f"{mesh['many_stream'][0] * 1e3:.2f} ms streamed ({mesh['many_stream'][1]:.3f}x direct), "
              f"{mesh['many'][0] * 1e3:.2f} ms final-only ({mesh['many'][1]:.3f}x direct); "
              f"{mesh['kill_many']} failed with a worker SIGKILLed")
        print(f"  rollmesh agents: CPU per short request {mesh['agent_short'] * 1e3:.3f} ms, per 1,000 streamed "
              f"tokens {mesh['agent_stream'] * 1e3:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
