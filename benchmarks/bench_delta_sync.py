"""Delta weight versions against full copies, in real training (run by hand; prints figures).

Each configuration is a real ``rollmesh train`` run: the quick start's job (its dataset, reward and
fully-async driver) on a preset model whose replicas serve bf16 while the trainer keeps float32 weights, for
``--steps`` steps at a given learning rate, with 1 or 4 standalone replicas, once with deltas
(``mesh.weight_delta_max_ratio: 0.5``, the default) and once with full copies only (0). Every step ends with a
weight sync; the controller's WEIGHT_SYNC_COMPLETED events (the run's events.jsonl) say what each serving sync
sent and how long it took, from the plan to the last replica's weights in place.

Per configuration it prints: the share of bf16 words that changed per version (median), bytes per version as a
delta and as a full copy, and the median serving-sync wall time with deltas and with full copies.

Loopback moves bytes at memory speed, where a sync of a small model is mostly fixed costs (RPCs, rendezvous,
the receivers' passes over the weights), as in no cluster: there a full copy of a real model takes seconds to
minutes on the wire. ``--link-gbit`` runs each configuration again with loopback shaped to that rate (``tc``
token bucket on ``lo``, root only, removed afterwards), so the wire's share of a sync is closer to a cluster's;
the time ratio then moves towards the byte ratio. Every process of the run shares the shaped link.
The replicas' weights are checked against the trainer's at every version by the replicas themselves (the
target manifest's checksum, or with the run's TLS its BLAKE3 bucket digests): a sync whose result differed
would be a failed sync, and the table counts those.

With ``--part join`` it measures replicas joining mid-training instead: the same job (``--serving`` replicas,
2 by default, deltas on) runs, an extra replica agent with ``--joiners`` free slots (1) registers at step
``--join-at``, and a native scale-out adds that many replicas there, taking the current version from peers
(``scale_out_weight_source: replica``, once per ``--peer-copy-sources`` value: how many peers the joiners are
split over) and once from the trainer. It prints the time from the scale-out to the new replicas serving and
their weight copies, and the trainer's weight-sync time for the steps the join overlapped against the others.

    .venv/bin/python -m benchmarks.bench_delta_sync                      # small-llama, 50 steps, 1e-6 and 1e-5
    .venv/bin/python -m benchmarks.bench_delta_sync --link-gbit 0 1      # loopback as is, then shaped to 1 Gbit/s
    .venv/bin/python -m benchmarks.bench_delta_sync --steps 10 --receivers 1
    .venv/bin/python -m benchmarks.bench_delta_sync --part join --steps 40
    .venv/bin/python -m benchmarks.bench_delta_sync --part join --serving 4 --joiners 4 --peer-copy-sources 1 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def job_config(tmp: Path, *, model: str, lr: float, receivers: int, delta: bool, steps: int,
               tls: bool = True) -> Path:
    """The quick start's job with this configuration's model, learning rate, replicas and delta setting."""
    job = yaml.safe_load(QUICKSTART.read_text())
    job["model"] = model
    job["data"]["train_files"] = [str((QUICKSTART.parent / f).resolve()) for f in job["data"]["train_files"]]
    job["custom_reward_function"]["path"] = str((QUICKSTART.parent / job["custom_reward_function"]["path"])
                                                .resolve())
    job["actor_rollout_ref"]["actor"]["optim"]["lr"] = lr
    job["actor_rollout_ref"]["rollout"]["dtype"] = "bfloat16"
    # bf16 replicas of a float32 trainer differ from it by more than the default guard's 0.1 nats per token on
    # the preset models (0.13 measured on small-llama): the trainer recomputes the log-probs it trains on
    job["actor_rollout_ref"]["actor"]["logprob_mismatch_action"] = "warn"
    job["rollout"]["n_gpus_per_node"] = receivers
    job["trainer"]["total_training_steps"] = steps
    job["trainer"]["checkpoint"] = False
    job["async_training"]["use_dynamic_resource_scheduling"] = False   # serving syncs only: one per step
    job["mesh"]["weight_delta_max_ratio"] = 0.5 if delta else 0.0
    job["mesh"]["tls"] = tls
    path = tmp / f"job-{model}-{lr:g}-{receivers}-{'delta' if delta else 'full'}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@contextlib.contextmanager
def shaped_loopback(gbit: float) -> Iterator[None]:
    """Loopback limited to ``gbit`` Gbit/s for the block (0: as it is)."""
    if not gbit:
        yield
        return
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{gbit}gbit", "burst", "4mb",
                    "latency", "100ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def run(config: Path, run_dir: Path) -> list[dict]:
    """Train; the serving syncs' event details, in order."""
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "rollmesh"), "train", "--config", str(config),
                           "--run-dir", str(run_dir)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"rollmesh train failed ({proc.returncode}); see {run_dir}/logs\n{proc.stderr[-2000:]}")
    syncs, failed = [], 0
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "WEIGHT_SYNC_FAILED":
            failed += 1
        if event["type"] == "WEIGHT_SYNC_COMPLETED" and event["details"].get("role") == "serving":
            syncs.append({**event["details"], "weight_version": event["weight_version"]})
    if failed:
        print(f"  {failed} weight sync(s) failed in {run_dir}")
    return syncs


JOIN_AGENT = """node_id: join
backend: torch
model: {model}
model_seed: 3
slots: {slots}
controller_address: {controller}
engine_options: {{dtype: bfloat16, max_batch_size: 64}}
weight_transfer: {{gloo_interface: lo}}
replicas: []
"""


async def join_run(tmp: Path, args: argparse.Namespace, source: str, sources: int) -> dict:
    """Train with deltas; at step ``join_at`` add ``--joiners`` replicas whose weights come from ``source``
    (peers: split over up to ``sources`` of them)."""
    import asyncio
    import os

    import grpc

    from tests.controller.scaling.helpers import controller_stub, finished, scale_out

    config = job_config(tmp, model=args.model, lr=args.lr[0], receivers=args.serving, delta=True,
                        steps=args.steps, tls=False)
    run_dir = tmp / f"join-{source}-{sources}"
    env = {**os.environ, "ROLLMESH_CONTROLLER__SCALE_OUT_WEIGHT_SOURCE": source,
           "ROLLMESH_CONTROLLER__PEER_COPY_SOURCES": str(sources)}
    train = await asyncio.create_subprocess_exec(str(ROOT / ".venv" / "bin" / "rollmesh"), "train", "--config",
                                                 str(config), "--run-dir", str(run_dir), cwd=ROOT, env=env,
                                                 stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    agent = None
    try:
        while not (run_dir / "events.jsonl").exists() or _steps_synced(run_dir) < args.join_at:
            if train.returncode is not None:
                sys.exit(f"rollmesh train ended early; see {run_dir}/logs")
            await asyncio.sleep(0.2)
        controller = json.loads((run_dir / "processes.json").read_text())["controller"]["address"]
        (tmp / "join.yaml").write_text(JOIN_AGENT.format(model=args.model, controller=controller,
                                                         slots=args.joiners))
        agent = await asyncio.create_subprocess_exec(
            str(ROOT / ".venv" / "bin" / "rollmesh"), "replica-agent", "--config", str(tmp / "join.yaml"),
            "--listen", "127.0.0.1:0", cwd=ROOT, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
            stdout=(tmp / f"join-agent-{source}-{sources}.log").open("wb"), stderr=asyncio.subprocess.STDOUT)
        async with grpc.aio.insecure_channel(controller) as channel:
            ctl = controller_stub(channel)
            while True:   # the new node registers
                try:
                    started = time.time()
                    op = await scale_out(ctl, num_replicas=args.serving + args.joiners)   # a target
                    break
                except grpc.aio.AioRpcError as err:
                    if "slot" not in (err.details() or "").lower():
                        raise
                    await asyncio.sleep(0.2)
            op = await finished(ctl, op.operation_id, timeout_s=600)
            ended = time.time()
        await train.wait()
    finally:
        for proc in (agent, train):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    mine = [e for e in events if e["operation_id"] == op.operation_id]
    copy = [e for e in mine if e["type"] == "WEIGHT_SYNC_COMPLETED"]
    syncing = [e["time"] for e in mine if e["to_state"] == "OPERATION_STATE_WEIGHT_SYNCING"]
    ready = [e["time"] for e in mine if e["to_state"] == "OPERATION_STATE_READY"]
    window = (syncing[0], ready[0]) if syncing and ready else (started, ended)
    serving_started = {e["weight_version"]: e["time"] for e in events
                       if e["type"] == "WEIGHT_SYNC_STARTED" and e["reason"] == "serving weight sync"}
    syncs = [((a["end"] - a["start"], serving_started.get(step["weight_version"], a["start"]) - a["start"]),
              a["start"] < window[1] and a["end"] > window[0])
             for step in json.loads((run_dir / "metrics.json").read_text())["steps"]
             for a in step.get("activities", []) if a["activity"] == "weight_sync"]
    return {"state": op.state, "join_s": ended - started, "window_s": window[1] - window[0],
            "copy_s": sum(float(e["details"].get("duration_s", 0.0)) for e in copy),
            "copies": [f"{e['details'].get('source')} v{e['weight_version']} ({_kinds(e['details'])})" for e in copy],
            "during": [d for d, overlaps in syncs if overlaps], "other": [d for d, overlaps in syncs if not overlaps]}


def _kinds(details: dict) -> str:
    """What copies a sync event counts: ``2 delta, 1 peer``."""
    counts = {"delta": details.get("delta_copies", 0), "peer": details.get("peer_copies", 0),
              "full": details.get("full_copies", 0) - details.get("peer_copies", 0)}
    return ", ".join(f"{int(n)} {kind}" for kind, n in counts.items() if n) or "none"


def _steps_synced(run_dir: Path) -> int:
    return sum(1 for line in (run_dir / "events.jsonl").read_text().splitlines()
               if '"WEIGHT_SYNC_COMPLETED"' in line and '"role": "serving"' in line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["sync", "join"], default="sync")
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[0.0],
                        help="loopback rates to run at, Gbit/s (0: unshaped); shaping needs root and tc")
    parser.add_argument("--join-at", type=int, default=10, help="step at which replicas join (--part join)")
    parser.add_argument("--joiners", type=int, default=1, help="replicas that join (--part join)")
    parser.add_argument("--serving", type=int, default=2, help="the job's replicas (--part join)")
    parser.add_argument("--peer-copy-sources", type=int, nargs="+", default=[4],
                        help="peer_copy_sources values to run the join from peers with (--part join)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args(argv)
    if args.part == "join":
        import asyncio

        from rollmesh.controller.v1 import scaling_pb2

        with tempfile.TemporaryDirectory() as tmpdir:
            tmp = args.keep or Path(tmpdir)
            tmp.mkdir(parents=True, exist_ok=True)
            results = {}
            for source, sources in [("replica", k) for k in args.peer_copy_sources] + [("trainer", 1)]:
                name = f"peers<={sources}" if source == "replica" else source
                print(f"running the join from {name} ...", flush=True)
                with shaped_loopback(args.link_gbit[0]):
                    results[name] = asyncio.run(join_run(tmp, args, source, sources))
        link = f"loopback shaped to {args.link_gbit[0]:g} Gbit/s" if args.link_gbit[0] else "loopback"
        print(f"\n{args.model}, {args.steps} steps at lr {args.lr[0]:g}, {args.serving} replicas, "
              f"{args.joiners} join at step {args.join_at}; {link}\n")
        print(f"{'source':>9} {'join s':>7} {'syncing s':>9} {'copy s':>7} {'step syncs during':>18} "
              f"{'other (median)':>14}  copies")
        for source, r in results.items():
            if r["state"] != scaling_pb2.OPERATION_STATE_ACTIVE:
                print(f"{source:>9} the scale-out ended {scaling_pb2.OperationState.Name(r['state'])}")
                continue
            during = ", ".join(f"{1e3 * d:.0f} ({1e3 * w:.0f})" for d, w in r["during"]) or "none"
            print(f"{source:>9} {r['join_s']:>7.2f} {r['window_s']:>9.3f} {r['copy_s']:>7.3f} {during:>18} "
                  f"{1e3 * statistics.median(d for d, _ in r['other']):>14.0f}  {'; '.join(r['copies'])}")
        print("\njoin s: ScaleOut to the new replicas serving; syncing s: their WEIGHT_SYNCING phase; copy s: "
              "their weight syncs (copies: source, version, kinds); step syncs: the trainer's weight-sync time "
              "(ms, CompleteTrainingStep) of the steps that overlapped the phase, in brackets how long it waited "
              "before its serving sync started (the controller's lock), and the median of the others.")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = args.keep or Path(tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        for gbit in args.link_gbit:
            for lr in args.lr:
                for receivers in args.receivers:
                    result = {}
                    for delta in (True, False):
                        config = job_config(tmp, model=args.model, lr=lr, receivers=receivers, delta=delta,
                                            steps=args.steps)
                        name = f"{config.stem}-{gbit:g}gbit"
                        print(f"running {name} ...", flush=True)
                        with shaped_loopback(gbit):
                            result[delta] = run(config, tmp / name)
                    rows.append((gbit, lr, receivers, result[True], result[False]))
    print(f"\n{args.model}, {args.steps} steps, replicas serve bf16; medians over the steps after the first "
          "(the first sync has no base)\n")
    print(f"{'link':>8} {'lr':>7} {'recv':>4} {'changed':>8} {'delta KiB':>9} {'full KiB':>9} {'bytes':>6} "
          f"{'t delta ms':>10} {'t full ms':>9} {'time':>6} {'deltas':>7}")
    for gbit, lr, receivers, with_delta, full in rows:
        later = [s for s in with_delta if s["weight_version"] > 1]
        deltas = [s for s in later if s.get("delta_base_version", -1) >= 0]
        density = statistics.median(s["delta_density"] for s in deltas) if deltas else float("nan")
        delta_bytes = statistics.median(s["bytes_sent"] for s in later)
        full_bytes = statistics.median(s["bytes_sent"] for s in full if s["weight_version"] > 1)
        t_delta = statistics.median(s["duration_s"] for s in later) * 1e3
        t_full = statistics.median(s["duration_s"] for s in full if s["weight_version"] > 1) * 1e3
        print(f"{f'{gbit:g} Gb/s' if gbit else 'loopback':>8} {lr:>7.0e} {receivers:>4} {100 * density:>7.2f}% {delta_bytes / 1024:>9.1f} "
              f"{full_bytes / 1024:>9.1f} {delta_bytes / full_bytes:>6.3f} {t_delta:>10.1f} "
              f"{t_full:>9.1f} {t_delta / t_full:>6.2f} {len(deltas):>3}/{len(later):<3}")
    print("\nchanged: median share of bf16 words changed per version; KiB: the stream the trainer sends per "
          "version (one stream, relayed down the receivers); bytes, time: delta over full.")


if __name__ == "__main__":
    main()
