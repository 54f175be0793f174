"""How large a fleet one controller holds (run by hand; prints figures, asserts nothing).

For each fleet size it starts a real controller process (SQLite state dir, no
balancer) and fake node agents in another process: one connection per node,
each the agent's own :class:`~replica_agent.controller_link.ControllerLink`
(10 s RegisterNode deadline, jittered backoff, honouring RetryInfo), all
connecting at once from a cold start, each reporting 8 replicas at the interval
the controller sets, with what loaded replicas report (running and waiting requests, KV use, token rates
and latencies, different at every report). Then, over a steady window, it measures

- controller CPU (% of one core) and RSS,
- GetStatus p50 / p99 (a probe every 100 ms),
- the time until every node was registered (cold start, all at once),
- spurious lease expiries (every agent is alive, so any is spurious),
- the event loop's worst stall in any second (``rollmesh_event_loop_stall_seconds``),
- the report interval the controller chose.

    .venv/bin/python -m benchmarks.bench_controller_scale --nodes 200,1000,2000,5000
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

REPLICAS_PER_NODE = 8


def _agents(address: str, first: int, count: int, ready: mp.Queue, stop: mp.Event) -> None:
    """A process of fake agents: ``count`` nodes, each with its own channel and ControllerLink."""
    from replica_agent.controller_link import ControllerLink
    from rollmesh.common.v1 import load_pb2, types_pb2
    from rollmesh.controller.v1 import registry_pb2

    async def main() -> None:
        links, tasks = [], []
        started = time.monotonic()
        for n in range(first, first + count):
            node = f"node-{n:05d}"
            replicas = [f"{node}-r{i}" for i in range(REPLICAS_PER_NODE)]
            registration = registry_pb2.RegisterNodeRequest(
                node_id=node, address=f"127.0.0.1:{10000 + n % 50000}", slots_total=REPLICAS_PER_NODE,
                replicas=[registry_pb2.ReplicaRegistration(
                    replica_id=r, kind=types_pb2.REPLICA_KIND_STANDALONE, state=types_pb2.REPLICA_STATE_ACTIVE,
                    slots=[i]) for i, r in enumerate(replicas)])
            link = ControllerLink(channel=grpc.aio.insecure_channel(address), registration=lambda m=registration: m,
                                  reports=functools.partial(loaded_reports, node, replicas, random.Random(n)),
                                  call_timeout_s=10.0)
            links.append(link)
        tasks = [asyncio.create_task(link.run()) for link in links]
        await asyncio.gather(*(link.registered.wait() for link in links))
        ready.put({"registered_s": time.monotonic() - started, "registrations": sum(l.registrations for l in links),
                   "interval_s": links[0].interval_s})
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    logging_off()
    asyncio.run(main())


def loaded_reports(node: str, replicas: list[str], rng: random.Random) -> list:
    """What 8 loaded replicas report: requests running and waiting, KV use, token rate and latencies, all
    different at every report (as the real agent's engine snapshots are)."""
    from rollmesh.common.v1 import load_pb2, types_pb2

    out = []
    for replica in replicas:
        running = rng.randint(16, 96)
        report = load_pb2.LoadReport(
            replica_id=replica, node_id=node, state=types_pb2.REPLICA_STATE_ACTIVE,
            kind=types_pb2.REPLICA_KIND_STANDALONE, running_requests=running, waiting_requests=rng.randint(0, 40),
            kv_cache_usage=rng.uniform(0.3, 0.95), max_total_tokens=262144, used_tokens=rng.randint(80000, 250000),
            generation_tokens_per_second=running * rng.uniform(25.0, 45.0))
        report.queue_time_p95.FromNanoseconds(int(rng.uniform(0.01, 2.0) * 1e9))
        report.time_to_first_token_p95.FromNanoseconds(int(rng.uniform(0.05, 3.0) * 1e9))
        report.inter_token_latency_mean.FromNanoseconds(int(rng.uniform(0.02, 0.04) * 1e9))
        report.inter_token_latency_p95.FromNanoseconds(int(rng.uniform(0.04, 0.09) * 1e9))
        report.reported_at.GetCurrentTime()
        out.append(report)
    return out


def logging_off() -> None:
    import logging
    logging.disable(logging.WARNING)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    match = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) / 1024 if match else 0.0


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(labels)} ([0-9.eE+-]+)$" if labels else rf"^{re.escape(name)} ([0-9.eE+-]+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


async def one_size(nodes: int, args) -> dict:
    from launcher.processes import start_server
    from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "controller.yaml"
        config.write_text(json.dumps({
            "listen": "127.0.0.1:0", "state_dir": str(Path(tmp) / "state"), "metrics_listen": "127.0.0.1:0",
            "lease_ttl_s": 10, "load_report_interval_s": 1, "max_load_reports_per_s": args.budget,
            "max_registrations_per_s": args.admission}))
        controller = await start_server("controller", ["--config", str(config)],   # INFO, as deployed
                                        log_path=Path(tmp) / "controller.log", ready_timeout_s=60)
        log = (Path(tmp) / "controller.log").read_text()
        metrics_url = "http://" + re.search(r"Prometheus metrics on http://(\S+)/metrics", log).group(1) + "/metrics" \
            if "Prometheus metrics on" in log else ""
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Queue(), ctx.Event()
        per = -(-nodes // args.agent_procs)
        procs = [ctx.Process(target=_agents, args=(controller.address, i * per, min(per, nodes - i * per), ready, stop))
                 for i in range(args.agent_procs) if i * per < nodes]
        cpu0 = _cpu_seconds(controller.pid)
        for proc in procs:
            proc.start()
        try:
            results = [await asyncio.to_thread(ready.get, True, args.register_timeout) for _ in procs]
            registered_s = max(r["registered_s"] for r in results)
            cpu_registration = _cpu_seconds(controller.pid) - cpu0
            channel = grpc.aio.insecure_channel(controller.address)
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            await asyncio.sleep(args.settle)
            cpu1, t1 = _cpu_seconds(controller.pid), time.monotonic()
            latencies, stalls = [], []
            next_scrape = time.monotonic()
            while time.monotonic() - t1 < args.window:
                started = time.perf_counter()
                await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=30)
                latencies.append(time.perf_counter() - started)
                if metrics_url and time.monotonic() >= next_scrape:
                    text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode())
                    stalls.append(_metric(text, "rollmesh_event_loop_stall_seconds"))
                    next_scrape += 1.0
                await asyncio.sleep(0.1)
            cpu = (_cpu_seconds(controller.pid) - cpu1) / (time.monotonic() - t1)
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode()) \
                if metrics_url else ""
            expiries = _metric(text, "rollmesh_controller_events_total", '{type="LEASE_EXPIRED"}')
            rss = _rss_mib(controller.pid)
            await channel.close()
        finally:
            stop.set()
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            await controller.terminate()
            if args.keep_logs:
                Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
                (Path(args.keep_logs) / f"controller-{nodes}.log").write_text((Path(tmp) / "controller.log").read_text())
        latencies.sort()
        return {"nodes": nodes, "replicas": nodes * REPLICAS_PER_NODE, "cpu_pct": 100 * cpu, "rss_mib": rss,
                "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
                "registered_s": registered_s, "registration_cpu_s": cpu_registration,
                "registrations": sum(r["registrations"] for r in results), "expiries": int(expiries),
                "worst_stall_ms": 1000 * max(stalls, default=0.0), "interval_s": results[0]["interval_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="200,1000,2000,5000")
    parser.add_argument("--agent-procs", type=int, default=1, help="processes the fake agents are spread over")
    parser.add_argument("--budget", type=float, default=2000.0, help="controller max_load_reports_per_s")
    parser.add_argument("--admission", type=float, default=500.0, help="controller max_registrations_per_s")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after registration before measuring")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady state measured")
    parser.add_argument("--register-timeout", type=float, default=300.0)
    parser.add_argument("--keep-logs", metavar="DIR", help="copy each run's controller log here")
    args = parser.parse_args()
    print(f"{REPLICAS_PER_NODE} replicas per node, lease_ttl_s 10, load_report_interval_s 1, max_load_reports_per_s "
          f"{args.budget:g}, max_registrations_per_s {args.admission:g}; {args.agent_procs} agent process(es)")
    print(f"{'nodes':>6} {'replicas':>8} {'interval':>8} {'cpu %':>6} {'rss MiB':>8} {'GetStatus p50/p99 ms':>21} "
          f"{'registered s':>12} {'tries':>6} {'expiries':>8} {'worst stall ms':>14}")
    for nodes in (int(n) for n in args.nodes.split(",")):
        r = asyncio.run(one_size(nodes, args))
        print(f"{r['nodes']:>6} {r['replicas']:>8} {r['interval_s']:>7.2f}s {r['cpu_pct']:>6.1f} {r['rss_mib']:>8.0f} "
              f"{r['p50_ms']:>10.1f} / {r['p99_ms']:>8.1f} {r['registered_s']:>12.2f} {r['registrations']:>6} "
              f"{r['expiries']:>8} {r['worst_stall_ms']:>14.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
