"""Load-balancer benchmarks (run by hand; prints figures).

1. Throughput: 4 synthetic replicas at a realistic pace, >= 256 concurrent requests
   of 128-512 tokens; completed requests/s through the balancer vs clients spreading
   the same requests directly over the replicas (target >= 0.95x).
2. Capacity: instant engines, short requests; the balancer's requests/s and its
   added p50/p99 latency over calling the replicas directly.
3. Mutual TLS: run 1 through the balancer again with every hop (client -> balancer ->
   replica agents) on mutual TLS, against plaintext (target >= 0.95x), and the p50
   latency mutual TLS adds to one short request at concurrency 1.
4. Several balancers: the capacity run of 2 through 1, 2 and 4 balancers (each routing the same 4 replicas)
   behind the consistent-hash client (``open_balancer_channel``); requests/s and the ratio to one balancer
   (target: near-linear until the machine's cores run out; the figures say how many it has), and the CPU
   each request costs the balancers (flat as N grows: the balancers share nothing). With
   ``--balancer-cpu F`` (Linux, root) each balancer is held to F of one core (a cgroup CFS quota,
   :mod:`benchmarks.cpu_quota`), so the balancers are the bottleneck even where the machine has fewer cores
   than processes, as N balancers on N machines would be.

    .venv/bin/python -m benchmarks.bench_loadbalancer [--requests 768] [--concurrency 256] [--only-tls]
        [--only-balancers] [--balancer-cpu 0.15]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from launcher.processes import start_server
from mesh_runtime import certs
from mesh_runtime.channels import open_channel
from mesh_runtime.config import TlsConfig
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2, replica_agent_pb2_grpc

AGENT = """node_id: {node}
slots: 2
backend: synthetic
stream_interval: 16
engine_options: {{tokens_per_second: {rate}, max_batch_size: 512, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: {node}-0}}, {{replica_id: {node}-1}}]
"""


def _tls_yaml(pki: Path | None, role: str, name: str) -> str:
    if pki is None:
        return ""
    if not (pki / f"{role}-{name}.pem").exists():
        certs.create_cert(pki, role, name)
    return f"tls: {{cert: {pki}/{role}-{name}.pem, key: {pki}/{role}-{name}.key, ca: {pki}/ca.pem}}\n"


def _client_tls(pki: Path | None, role: str = "client") -> TlsConfig | None:
    if pki is None:
        return None
    _tls_yaml(pki, role, "bench")
    return TlsConfig(cert=str(pki / f"{role}-bench.pem"), key=str(pki / f"{role}-bench.key"), ca=str(pki / "ca.pem"))


async def start_cluster(tmp: Path, rate: str, pki: Path | None = None):
    agents = {}
    for node in ("n0", "n1"):
        (tmp / f"{node}.yaml").write_text(AGENT.format(node=node, rate=rate) + _tls_yaml(pki, "replica-agent", node))
        agents[node] = await start_server("replica-agent", ["--config", str(tmp / f"{node}.yaml"),
                                                            "--listen", "127.0.0.1:0"], log_path=tmp / f"{node}.log")
    (tmp / "lb.yaml").write_text(_tls_yaml(pki, "lb", "lb") or "{}\n")
    lb = await start_server("lb", ["--config", str(tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "lb.log")
    replicas = [(f"{n}-{i}", a.address) for n, a in agents.items() for i in range(2)]
    async with open_channel(lb.address, tls=_client_tls(pki, "controller")) as ch:
        await loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).AddReplicas(loadbalancer_pb2.AddReplicasRequest(
            replicas=[routing_pb2.ReplicaEndpoint(replica_id=r, address=a) for r, a in replicas]))
    return [lb, *agents.values()], lb.address, replicas


async def drive(calls, concurrency: int) -> tuple[float, list[float]]:
    """Run the call factories with bounded concurrency; (wall seconds, per-call latencies)."""
    queue = list(calls)
    latencies: list[float] = []

    async def worker():
        while queue:
            call = queue.pop()
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies


def budgets(n: int, low: int, high: int) -> list[int]:
    rng = random.Random(1)
    return [rng.randint(low, high) for _ in range(n)]


async def via_lb(address: str, sizes: list[int], concurrency: int, tag: str, tls: TlsConfig | None = None,
                 opener=open_channel):
    """Generate ``sizes`` through the balancer(s) at ``address`` (``opener`` makes the channel)."""
    async with opener(address, tls=tls) as ch:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch)

        def call(i: int, size: int):
            async def run():
                req = loadbalancer_pb2.GenerateRequest(
                    request_id=f"{tag}-{i}", prompt_token_ids=[1, 2, 3],
                    sampling_params=generation_pb2.SamplingParams(max_tokens=size, ignore_eos=True))
                async for _ in stub.Generate(req, timeout=600):
                    pass
            return run
        return await drive([call(i, s) for i, s in enumerate(sizes)], concurrency)


async def direct(replicas, sizes: list[int], concurrency: int, tag: str):
    channels = {a: grpc.aio.insecure_channel(a) for _, a in replicas}
    stubs = {a: replica_agent_pb2_grpc.ReplicaAgentServiceStub(c) for a, c in channels.items()}
    spread = itertools.cycle(replicas)

    def call(i: int, size: int):
        replica_id, address = next(spread)

        async def run():
            req = replica_agent_pb2.GenerateRequest(
                replica_id=replica_id, request_id=f"{tag}-{i}", prompt_token_ids=[1, 2, 3],
                sampling_params=generation_pb2.SamplingParams(max_tokens=size, ignore_eos=True))
            async for _ in stubs[address].Generate(req, timeout=600):
                pass
        return run
    try:
        return await drive([call(i, s) for i, s in enumerate(sizes)], concurrency)
    finally:
        for ch in channels.values():
            await ch.close()


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=768)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--rate", type=float, default=200.0, help="tokens/s per request of the synthetic engines")
    parser.add_argument("--capacity-requests", type=int, default=2000)
    parser.add_argument("--only-tls", action="store_true", help="run only the mutual-TLS comparison")
    parser.add_argument("--only-balancers", action="store_true", help="run only the 1/2/4-balancer capacity runs")
    parser.add_argument("--balancer-cpu", type=float, default=0.0,
                        help="hold each balancer to this fraction of one core (cgroup quota; 0: no limit)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        if args.only_balancers:
            await balancer_runs(tmp, args)
            return
        if not args.only_tls:
            await plain_runs(tmp, args)
        await tls_runs(tmp, args)
        await balancer_runs(tmp, args)


async def balancer_runs(tmp: Path, args) -> None:
    """Capacity through N balancers behind the consistent-hash client, N = 1, 2, 4."""
    import contextlib  # noqa: PLC0415
    import os  # noqa: PLC0415

    from benchmarks.cpu_quota import cpu_quota, cpu_seconds, machine_busy_seconds  # noqa: PLC0415
    from mesh_runtime.hash_ring import open_balancer_channel  # noqa: PLC0415

    procs, first, replicas = await start_cluster(tmp, ".inf")
    extra = []
    try:
        for i in range(3):   # three more balancers routing the same replicas
            (tmp / f"lb{i}.yaml").write_text("{}\n")
            lb = await start_server("lb", ["--config", str(tmp / f"lb{i}.yaml"), "--listen", "127.0.0.1:0"],
                                    log_path=tmp / f"lb{i}.log")
            extra.append(lb)
            async with open_channel(lb.address) as ch:
                await loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).AddReplicas(loadbalancer_pb2.AddReplicasRequest(
                    replicas=[routing_pb2.ReplicaEndpoint(replica_id=r, address=a) for r, a in replicas]))
        balancers = [procs[0], *extra]
        addresses = [lb.address for lb in balancers]
        sizes = [16] * args.capacity_requests
        limit = (f"each balancer held to {args.balancer_cpu:g} of a core" if args.balancer_cpu
                 else "no CPU limit")
        print(f"several balancers ({args.capacity_requests} requests of 16 tokens, instant engines, 128 concurrent, "
              f"one client process, {os.cpu_count()} cores for everything, {limit})")
        quota = (cpu_quota({f"lb{i}": lb.pid for i, lb in enumerate(balancers)}, args.balancer_cpu)
                 if args.balancer_cpu else contextlib.nullcontext())
        base = None
        with quota:
            for count in (1, 2, 4):
                joined = ",".join(addresses[:count])
                await via_lb(joined, [16] * 200, 32, f"warm{count}", opener=open_balancer_channel)   # warm each
                used, busy = [cpu_seconds(lb.pid) for lb in balancers[:count]], machine_busy_seconds()
                wall, lat = await via_lb(joined, sizes, 128, f"b{count}", opener=open_balancer_channel)
                used = [cpu_seconds(lb.pid) - before for lb, before in zip(balancers[:count], used)]
                busy = machine_busy_seconds() - busy
                rate = args.capacity_requests / wall
                base = base or rate
                print(f"  {count} balancer(s): {rate:8.1f} req/s  ({rate / base:4.2f}x)  "
                      f"p50 {pct(lat, 50) * 1e3:6.1f} ms  p99 {pct(lat, 99) * 1e3:6.1f} ms  "
                      f"balancer CPU {sum(used) / args.capacity_requests * 1e3:5.2f} ms/request "
                      f"({sum(used) / wall:4.2f} cores busy; the machine {busy / wall:4.2f} of {os.cpu_count()})")
    finally:
        await asyncio.gather(*(p.terminate() for p in [*procs, *extra]))


async def tls_runs(tmp: Path, args) -> None:
    pki = tmp / "pki"
    certs.create_ca(pki)
    sizes = budgets(args.requests, 128, 512)
    walls, seq = {}, {}
    for mode, where in (("plaintext", None), ("mutual TLS", pki)):
        procs, lb, _ = await start_cluster(tmp, str(args.rate), where)
        try:
            tls = _client_tls(where)
            await via_lb(lb, [16] * 100, 32, f"warm-{mode}", tls)
            walls[mode], _ = await via_lb(lb, sizes, args.concurrency, f"t-{mode}", tls)
            seq[mode] = (await via_lb(lb, [16] * 300, 1, f"s-{mode}", tls))[1]
        finally:
            await asyncio.gather(*(p.terminate() for p in procs))
    print(f"mutual TLS on every hop ({args.requests} requests of 128-512 tokens, {args.concurrency} concurrent, "
          f"{args.rate:.0f} tok/s per request)")
    for mode, wall in walls.items():
        print(f"  {mode:<12}   {args.requests / wall:8.1f} req/s  ({wall:.1f} s)   "
              f"one 16-token request: p50 {pct(seq[mode], 50) * 1e3:6.2f} ms")
    print(f"  ratio:         {walls['plaintext'] / walls['mutual TLS']:8.3f}x   (target >= 0.95)")
    print(f"  added p50 at concurrency 1: {(pct(seq['mutual TLS'], 50) - pct(seq['plaintext'], 50)) * 1e3:5.2f} ms")


async def plain_runs(tmp: Path, args) -> None:
    procs, lb, replicas = await start_cluster(tmp, str(args.rate))
    try:
        sizes = budgets(args.requests, 128, 512)
        d_wall, _ = await direct(replicas, sizes, args.concurrency, "d")
        l_wall, _ = await via_lb(lb, sizes, args.concurrency, "l")
        print(f"throughput ({args.requests} requests of 128-512 tokens, {args.concurrency} concurrent, "
              f"{args.rate:.0f} tok/s per request, 4 replicas)")
        print(f"  direct:        {args.requests / d_wall:8.1f} req/s  ({d_wall:.1f} s)")
        print(f"  via balancer:  {args.requests / l_wall:8.1f} req/s  ({l_wall:.1f} s)")
        print(f"  ratio:         {d_wall / l_wall:8.3f}x   (target >= 0.95)")
    finally:
        await asyncio.gather(*(p.terminate() for p in procs))
    procs, lb, replicas = await start_cluster(tmp, ".inf")
    try:
        sizes = [16] * args.capacity_requests
        await via_lb(lb, sizes[:200], 32, "warm")
        d_wall, d_lat = await direct(replicas, sizes, 64, "cd")
        l_wall, l_lat = await via_lb(lb, sizes, 64, "cl")
        print(f"capacity ({args.capacity_requests} requests of 16 tokens, instant engines, 64 concurrent)")
        print(f"  direct:        {args.capacity_requests / d_wall:8.1f} req/s  p50 {pct(d_lat, 50) * 1e3:6.1f} ms"
              f"  p99 {pct(d_lat, 99) * 1e3:6.1f} ms")
        print(f"  via balancer:  {args.capacity_requests / l_wall:8.1f} req/s  p50 {pct(l_lat, 50) * 1e3:6.1f} ms"
              f"  p99 {pct(l_lat, 99) * 1e3:6.1f} ms")
        seq_d = [await_time for await_time in (await direct(replicas, [16] * 200, 1, "sd"))[1]]
        seq_l = [await_time for await_time in (await via_lb(lb, [16] * 200, 1, "sl"))[1]]
        print(f"  added latency at concurrency 1: p50 {(pct(seq_l, 50) - pct(seq_d, 50)) * 1e3:5.2f} ms, "
              f"p99 {(pct(seq_l, 99) - pct(seq_d, 99)) * 1e3:5.2f} ms")
    finally:
        await asyncio.gather(*(p.terminate() for p in procs))


if __name__ == "__main__":
    asyncio.run(main())
