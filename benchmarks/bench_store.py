"""The state store, measured (run by hand): acknowledged step-protocol calls on SQLite and on etcd, and the
takeover of an etcd store when its controller dies.

A controller process runs the step protocol (BeginTrainingStep, then
CompleteTrainingStep, each durable before its reply) for ``--steps`` steps,
once with ``store`` on a SQLite file and once on a single-member etcd (Debian's
``etcd``) on loopback, both in a temporary directory; prints the per-call
latency seen by the client (median, p90, p99). Then two controllers share the
etcd store (lease ``--ttl`` seconds); the owner is killed -9 ``--failovers``
times and the time from the kill to the first acknowledged RegisterNode of a
client given both addresses (it follows the leader) is printed (target: at
most twice the lease).

    .venv/bin/python -m benchmarks.bench_store [--steps 300] [--ttl 2] [--failovers 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from launcher.processes import ServerProcess, start_server
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2, scheduling_pb2
from tests.etcd_server import etcd_cluster


async def measure(store: str, tmp: Path, steps: int) -> dict[str, list[float]]:
    config = tmp / f"{store.split(':')[0]}.yaml"
    config.write_text(f"store: {store}\n")
    controller = await start_server("controller", ["--config", str(config), "--listen", "127.0.0.1:0"],
                                    log_path=tmp / "controller.log")
    times: dict[str, list[float]] = {"BeginTrainingStep": [], "CompleteTrainingStep": []}
    try:
        async with grpc.aio.insecure_channel(controller.address) as channel:
            ctl = controller_pb2_grpc.ControllerServiceStub(channel)
            report = scheduling_pb2.StepReport(required_samples=8, trigger_parameter_sync_step=1, expected_samples=8)
            for step in range(1, steps + 1):
                started = time.perf_counter()
                await ctl.BeginTrainingStep(scheduling_pb2.BeginTrainingStepRequest(global_step=step, report=report))
                times["BeginTrainingStep"].append(time.perf_counter() - started)
                started = time.perf_counter()
                await ctl.CompleteTrainingStep(scheduling_pb2.CompleteTrainingStepRequest(
                    global_step=step, weight_version=step, report=report))
                times["CompleteTrainingStep"].append(time.perf_counter() - started)
    finally:
        await controller.terminate()
    return times


async def _controller(tmp: Path, name: str, store: str, ttl: int) -> ServerProcess:
    config = tmp / f"{name}.yaml"
    config.write_text(f"store: {store}\nstore_lease_ttl_s: {ttl}\nnode_id: {name}\n")
    return await start_server("controller", ["--config", str(config), "--listen", "127.0.0.1:0"],
                              log_path=tmp / f"{name}.log", ready_timeout_s=120)


async def failover(store: str, tmp: Path, ttl: int, rounds: int) -> list[float]:
    """Seconds from kill -9 of the leader to the first acknowledged RegisterNode, sent by a client given both
    controllers' addresses (it follows the leader: the time is what a caller sees)."""
    from mesh_runtime.channels import open_channel  # noqa: PLC0415

    times = []
    leader = await _controller(tmp, "c0", store, ttl)
    for i in range(1, rounds + 1):
        standby = await _controller(tmp, f"c{i}", store, ttl)   # serves at once, as a standby
        async with open_channel(f"{leader.address},{standby.address}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            killed = time.perf_counter()
            await leader.kill()
            await stub.RegisterNode(registry_pb2.RegisterNodeRequest(
                node_id=f"n{i}", address="127.0.0.1:40001", slots_total=1), timeout=60)
            times.append(time.perf_counter() - killed)
        leader = standby
    await leader.terminate()
    return times


def _figures(samples: list[float]) -> str:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return f"median {statistics.median(ordered) * 1e3:6.2f} ms  p90 {pick(0.9):6.2f} ms  p99 {pick(0.99):6.2f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ttl", type=int, default=2, help="store_lease_ttl_s of the failover runs")
    parser.add_argument("--failovers", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as name:
        tmp = Path(name)
        results = {"sqlite": await measure(f"sqlite://{tmp / 'controller.sqlite'}", tmp, args.steps)}
        with etcd_cluster(tmp / "etcd") as cluster:
            results["etcd (1 member)"] = await measure(cluster.url("/bench"), tmp, args.steps)
            takeovers = await failover(cluster.url("/failover"), tmp, args.ttl, args.failovers)
    for store, times in results.items():
        for call, samples in times.items():
            print(f"{store:16s} {call:22s} {_figures(samples)}  ({len(samples)} calls)")
    print(f"takeover after kill -9 (lease {args.ttl} s): "
          + ", ".join(f"{t:.2f}" for t in takeovers) + f" s; max {max(takeovers):.2f} s, target <= {2 * args.ttl} s")


if __name__ == "__main__":
    asyncio.run(main())
