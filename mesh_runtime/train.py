"""``rollmesh train --config FILE``: fully-async RL training on a local mesh, end to end.

The module stays import-light (``rollmesh --help`` imports it to build the
parser); the job itself lives in :mod:`mesh_runtime.train_job`. A config that
cannot work is rejected before any process starts, with exit code 2 and the
keys named.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

HELP = "train on a local mesh (controller, balancer, replica agents, trainer agent) and summarise the run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="job YAML (see examples/quickstart.yaml; keys as in the reference)")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="directory for events, metrics, spans, logs and the picture (default: runs/<config name>-<time>)")
    parser.add_argument("--steps", type=int, metavar="N", help="override trainer.total_training_steps")
    parser.add_argument("--seed", type=int, metavar="N", help="override seed (model initialisation)")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    from .config import ConfigError  # noqa: PLC0415
    from .job_config import load_job_config  # noqa: PLC0415

    overrides: dict = {}
    if args.steps is not None:
        overrides["trainer.total_training_steps"] = args.steps
    if args.seed is not None:
        overrides["seed"] = args.seed
    try:
        job = load_job_config(args.config, overrides)
    except ConfigError as err:
        print(f"rollmesh train: error: {err}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or Path("runs") / f"{Path(args.config).stem}-{stamp}")
    if (run_dir / "checkpoint").exists() or (run_dir / "events.jsonl").exists():
        print(f"rollmesh train: error: run directory {run_dir} holds an earlier run; pass a new --run-dir "
              "or remove it", file=sys.stderr)
        return 2
    return asyncio.run(_main(job, run_dir, env))


async def _main(job, run_dir: Path, env: dict[str, str]) -> int:
    from .train_job import TrainJob  # noqa: PLC0415

    task = asyncio.create_task(TrainJob(job, run_dir, env).run())
    loop = asyncio.get_running_loop()
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            print("\nrollmesh train: interrupted; stopping every process", file=sys.stderr, flush=True)
            task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    try:
        return await task
    except asyncio.CancelledError:
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
