"""Latency of acknowledged step-protocol calls with the SQLite and the etcd state store (run by hand).

A controller process runs the step protocol (BeginTrainingStep, then
CompleteTrainingStep, each durable before its reply) for ``--steps`` steps,
once with ``store`` on a SQLite file and once on a single-member etcd (Debian's
``etcd``) on loopback, both in a temporary directory; prints the per-call
latency seen by the client (median, p90, p99).

    .venv/bin/python -m benchmarks.bench_store [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from launcher.processes import start_server
from rollmesh.controller.v1 import controller_pb2_grpc, scheduling_pb2
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


def _figures(samples: list[float]) -> str:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return f"median {statistics.median(ordered) * 1e3:6.2f} ms  p90 {pick(0.9):6.2f} ms  p99 {pick(0.99):6.2f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-store-") as name:
        tmp = Path(name)
        results = {"sqlite": await measure(f"sqlite://{tmp / 'controller.sqlite'}", tmp, args.steps)}
        with etcd_cluster(tmp / "etcd") as cluster:
            results["etcd (1 member)"] = await measure(cluster.url("/bench"), tmp, args.steps)
    for store, times in results.items():
        for call, samples in times.items():
            print(f"{store:16s} {call:22s} {_figures(samples)}  ({len(samples)} calls)")


if __name__ == "__main__":
    asyncio.run(main())
