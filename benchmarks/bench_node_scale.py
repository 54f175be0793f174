"""One node's token rate against its replica count: replicas in the agent's process vs in processes of their
own (``replica_processes``). Run by hand; prints figures.

One ``rollmesh replica-agent`` with N synthetic replicas (N = 1, then 4). Each replica's serving process is
held to ``--replica-cpu`` of one core (a cgroup CFS quota, :mod:`benchmarks.cpu_quota`; Linux, root): with
replica processes, each replica process gets that share; with replicas in the agent's process, that process
gets it, as the one core an event loop can use. So a node's replicas are the bottleneck on purpose even on
a machine with few cores, as N replicas each driving its own GPU from its own core would be.

Load: client processes (``--clients``) stream requests straight to the replicas (the balancer is measured
elsewhere), prompts of 16-256 random tokens, outputs of 32-256 tokens (uniform), the engine emitting each
request at ``--rate`` tokens/s (default 2,000: a fast GPU decode), 64 requests in flight per replica, new
ones as old ones finish, for ``--seconds`` after a warm-up. Reported: output tokens/s of the node, the 4-to-1
ratio (target >= 3x with replica processes), the CPU per 1,000 tokens of the serving processes and of the
agent (with replica processes the agent only supervises).

    .venv/bin/python -m benchmarks.bench_node_scale [--replica-cpu 0.2] [--seconds 10] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.cpu_quota import cpu_quota, cpu_seconds, machine_busy_seconds
from launcher.processes import start_server
from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc

AGENT = """node_id: bench
slots: {n}
backend: synthetic
replica_processes: {processes}
engine_options: {{tokens_per_second: {rate}, max_batch_size: 1024, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{replicas}]
"""
IN_FLIGHT = 64


def _client(targets: list[tuple[str, str]], seconds: float, warmup: float, seed: int, out) -> None:
    """One client process: keeps IN_FLIGHT requests on each (address, replica_id) until the time is up;
    puts the output tokens finished inside the measured window."""

    async def run() -> int:
        rng = random.Random(seed)
        start = time.monotonic()
        counted = 0
        channels = {a: grpc.aio.insecure_channel(a) for a in {a for a, _ in targets}}
        stubs = {a: replica_agent_pb2_grpc.ReplicaAgentServiceStub(c) for a, c in channels.items()}

        async def worker(address: str, replica_id: str, index: int) -> None:
            nonlocal counted
            i = 0
            while time.monotonic() - start < warmup + seconds:
                i += 1
                request = pb.GenerateRequest(
                    replica_id=replica_id, request_id=f"{seed}-{replica_id}-{index}-{i}",
                    prompt_token_ids=[rng.randrange(32000) for _ in range(rng.randint(16, 256))],
                    sampling_params=generation_pb2.SamplingParams(max_tokens=rng.randint(32, 256), ignore_eos=True))
                got = 0
                async for reply in stubs[address].Generate(request, timeout=120):
                    got += len(reply.token_ids)
                done = time.monotonic() - start
                if warmup <= done <= warmup + seconds:
                    counted += got

        await asyncio.gather(*(worker(a, r, i) for a, r in targets for i in range(IN_FLIGHT)))
        for channel in channels.values():
            await channel.close()
        return counted

    out.put(asyncio.run(run()))


def _serving_pids(agent_pid: int) -> list[int]:
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    return [int(c) for c in children
            if b"replica_agent.replica_process" in Path(f"/proc/{c}/cmdline").read_bytes()]


async def one_run(tmp: Path, args, n: int, processes: bool) -> dict:
    names = [f"r{i}" for i in range(n)]
    (tmp / "agent.yaml").write_text(AGENT.format(n=n, processes=str(processes).lower(), rate=args.rate,
                                                 replicas=", ".join(f"{{replica_id: {r}}}" for r in names)))
    agent = await start_server("replica-agent", ["--config", str(tmp / "agent.yaml"), "--listen", "127.0.0.1:0"],
                               log_path=tmp / "agent.log", ready_timeout_s=120)
    try:
        async with grpc.aio.insecure_channel(agent.address) as channel:
            stub = replica_agent_pb2_grpc.ReplicaAgentServiceStub(channel)
            for _ in range(600):
                listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
                if len(listed) == n and all(r.state == 4 for r in listed):
                    break
                await asyncio.sleep(0.1)
        targets = [(r.data_address or agent.address, r.replica_id) for r in listed]
        serving = _serving_pids(agent.pid) if processes else [agent.pid]
        with cpu_quota({f"s{i}": pid for i, pid in enumerate(serving)}, args.replica_cpu):
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            shares = [targets[i::args.clients] for i in range(args.clients)]
            clients = [ctx.Process(target=_client, args=(share, args.seconds, args.warmup, i, out))
                       for i, share in enumerate(shares) if share]
            for client in clients:
                client.start()
            await asyncio.sleep(args.warmup)
            used = {pid: cpu_seconds(pid) for pid in {*serving, agent.pid}}
            busy, started = machine_busy_seconds(), time.monotonic()
            await asyncio.sleep(args.seconds)
            used = {pid: cpu_seconds(pid) - before for pid, before in used.items()}
            busy, wall = machine_busy_seconds() - busy, time.monotonic() - started
            tokens = sum(await asyncio.gather(*(asyncio.to_thread(out.get, True, 300) for _ in clients)))
            for client in clients:
                client.join(timeout=30)
    finally:
        await agent.terminate()
    serving_cpu = sum(used[p] for p in serving)
    return {"tokens_per_s": tokens / wall, "serving_ms_per_1k": serving_cpu / max(tokens, 1) * 1e6,
            "agent_ms_per_1k": (used[agent.pid] / max(tokens, 1) * 1e6) if processes else None,
            "serving_cores": serving_cpu / wall, "machine_cores": busy / wall}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica-cpu", type=float, default=0.2, help="share of one core per serving process")
    parser.add_argument("--rate", type=float, default=2000.0, help="tokens/s per request of the synthetic engine")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    args = parser.parse_args()
    print(f"one node, synthetic replicas; each serving process held to {args.replica_cpu:g} of a core; "
          f"{IN_FLIGHT} requests in flight per replica (prompts 16-256, outputs 32-256 tokens at {args.rate:g} "
          f"tokens/s each); {args.clients} client processes; {os.cpu_count()} cores for everything")
    with tempfile.TemporaryDirectory() as tmpdir:
        for processes in (False, True):
            mode = "replica processes" if processes else "replicas in the agent's process"
            figures = {}
            for n in (1, 4):
                figures[n] = await one_run(Path(tmpdir), args, n, processes)
                f = figures[n]
                agent = (f", agent {f['agent_ms_per_1k']:5.2f} ms" if f["agent_ms_per_1k"] is not None else "")
                print(f"  {mode:31s} {n} replica(s): {f['tokens_per_s']:9.0f} tokens/s  serving CPU "
                      f"{f['serving_ms_per_1k']:5.2f} ms per 1,000 tokens{agent}  ({f['serving_cores']:4.2f} "
                      f"cores serving, machine {f['machine_cores']:4.2f} of {os.cpu_count()})")
            print(f"  {mode:31s} 4 vs 1: {figures[4]['tokens_per_s'] / figures[1]['tokens_per_s']:4.2f}x")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
