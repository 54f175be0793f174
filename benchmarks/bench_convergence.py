"""How fast the mesh heals (run by hand; prints figures).

1. Balancer restart: SIGKILL the balancer and start it again on the same port; the time
   from the new balancer being up until its routing table holds every replica again
   (the controller reconciles every ``reconcile_interval_s``).
2. Frozen agent: SIGSTOP one of two agents while long requests stream from both; for
   each request that was on the frozen agent, the time from the freeze until its next
   token arrives from elsewhere (lease expiry -> removal with abort -> resume).
3. A replica killed for good: four agents with one replica each, requests at
   concurrency 32, one agent SIGKILLed mid-run and never restarted; requests that
   failed (target 0).

    .venv/bin/python -m benchmarks.bench_convergence [--lease-ttl 4] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from launcher.processes import start_server
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

AGENT = """node_id: {node}
slots: 1
backend: synthetic
controller_address: {controller}
stream_interval: 4
engine_options: {{tokens_per_second: {rate}, max_batch_size: 512, lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: {node}-0}}]
"""
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: {ttl}
load_report_interval_s: {interval}
reconcile_interval_s: 2.0
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mesh:
    def __init__(self, tmp: Path, args, agents: int) -> None:
        self.tmp, self.args, self.count = tmp, args, agents
        self.procs: dict[str, object] = {}
        self.lb_address = f"127.0.0.1:{free_port()}"

    async def start(self) -> None:
        await self.start_lb()
        (self.tmp / "c.yaml").write_text(CONTROLLER.format(lb=self.lb_address, ttl=self.args.lease_ttl,
                                                           interval=self.args.lease_ttl / 8))
        self.procs["controller"] = await start_server("controller", ["--config", str(self.tmp / "c.yaml"),
                                                                     "--listen", "127.0.0.1:0"],
                                                      log_path=self.tmp / "c.log")
        for i in range(self.count):
            node = f"a{i}"
            (self.tmp / f"{node}.yaml").write_text(AGENT.format(node=node, rate=self.args.rate,
                                                                controller=self.procs["controller"].address))
            self.procs[node] = await start_server("replica-agent", ["--config", str(self.tmp / f"{node}.yaml"),
                                                                    "--listen", "127.0.0.1:0"],
                                                  log_path=self.tmp / f"{node}.log")
        await self.wait_routed(self.count, 60)

    async def start_lb(self) -> None:
        self.procs["lb"] = await start_server("lb", ["--listen", self.lb_address], log_path=self.tmp / "lb.log")

    async def routed(self) -> set[str]:
        async with grpc.aio.insecure_channel(self.lb_address) as ch:
            reply = await loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch).ListReplicas(
                loadbalancer_pb2.ListReplicasRequest(), timeout=5)
        return {r.endpoint.replica_id for r in reply.replicas if r.routable}

    async def wait_routed(self, count: int, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                if len(await self.routed()) >= count:
                    return time.monotonic() - started
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
        raise TimeoutError(f"routing did not reach {count} replicas within {timeout_s} s")

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.process.returncode is None:
                os.kill(proc.pid, signal.SIGCONT)   # a frozen one must be able to stop
        await asyncio.gather(*(p.terminate() for p in self.procs.values()), return_exceptions=True)


async def generate(address: str, request_id: str, max_tokens: int, on_token=None) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(ch)
        req = loadbalancer_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=[1, 2, 3],
            sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        try:
            async for msg in stub.Generate(req, timeout=300):
                if on_token is not None and msg.token_ids:
                    on_token(msg.replica_id, time.monotonic())
                if msg.finish_reason:
                    return True
        except grpc.aio.AioRpcError:
            return False
    return False


async def balancer_restart(tmp: Path, args) -> None:
    mesh = Mesh(tmp / "restart", args, 2)
    mesh.tmp.mkdir()
    await mesh.start()
    try:
        times = []
        for _ in range(args.rounds):
            await mesh.procs["lb"].kill()
            await mesh.start_lb()
            times.append(await mesh.wait_routed(2, 60))
        print(f"balancer restart -> routing restored: median {statistics.median(times):.2f} s, "
              f"max {max(times):.2f} s over {len(times)} restarts (reconcile_interval_s 2): "
              f"{', '.join(f'{t:.2f}' for t in times)}")
    finally:
        await mesh.stop()


async def frozen_agent(tmp: Path, args) -> None:
    mesh = Mesh(tmp / "frozen", args, 2)
    mesh.tmp.mkdir()
    await mesh.start()
    try:
        last: dict[str, tuple[str, float]] = {}
        resumed: dict[str, float] = {}
        frozen_at = [0.0]

        def tracker(rid: str):
            def on_token(replica_id: str, at: float) -> None:
                previous = last.get(rid)
                if frozen_at[0] and previous and previous[0] == "a0-0" and replica_id != "a0-0" \
                        and rid not in resumed:
                    resumed[rid] = at - frozen_at[0]
                last[rid] = (replica_id, at)
            return on_token

        budget = int(args.rate * (args.lease_ttl * 4 + 10))
        tasks = [asyncio.ensure_future(generate(mesh.lb_address, f"f{i}", budget, tracker(f"f{i}")))
                 for i in range(16)]
        await asyncio.sleep(2.0)
        on_frozen = [rid for rid, (replica, _) in last.items() if replica == "a0-0"]
        frozen_at[0] = time.monotonic()
        os.kill(mesh.procs["a0"].pid, signal.SIGSTOP)
        done = await asyncio.gather(*tasks)
        waits = [resumed[r] for r in on_frozen if r in resumed]
        print(f"frozen agent (lease_ttl_s {args.lease_ttl}, reports every {args.lease_ttl / 8:.2f} s): "
              f"{len(waits)} of {len(on_frozen)} of its requests continued elsewhere after median "
              f"{statistics.median(waits) if waits else float('nan'):.2f} s, max {max(waits, default=float('nan')):.2f} s; "
              f"{sum(done)} of {len(done)} requests completed")
    finally:
        await mesh.stop()


async def killed_for_good(tmp: Path, args) -> None:
    mesh = Mesh(tmp / "killed", args, 4)
    mesh.tmp.mkdir()
    await mesh.start()
    try:
        queue = list(range(args.requests))
        results: list[bool] = []

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await generate(mesh.lb_address, f"k{i}", 64))

        workers = [asyncio.ensure_future(worker()) for _ in range(32)]
        while len(results) < args.requests // 4:
            await asyncio.sleep(0.05)
        await mesh.procs["a1"].kill()
        await asyncio.gather(*workers)
        print(f"one of four replicas killed for good mid-run: {results.count(False)} of {len(results)} requests "
              f"failed (target 0)")
    finally:
        await mesh.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lease-ttl", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per request of the synthetic engines")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="balancer restarts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        await balancer_restart(tmp, args)
        await frozen_agent(tmp, args)
        await killed_for_good(tmp, args)


if __name__ == "__main__":
    asyncio.run(main())
