"""``rollmesh train --config FILE``: fully-async RL training on a local mesh, end to end.

Ctrl-C ends the run after the step the trainer is in, as a normal end
does (StopTraining: requests cancelled, the last step synced and
checkpointed, the model and the summary written; exit 0); a second Ctrl-C,
or SIGTERM, stops every process at once (exit 130).

``rollmesh train --config FILE --resume RUN_DIR`` continues an interrupted
(SIGTERM, a second Ctrl-C, a crash) or stopped-early run in place, from ``RUN_DIR/checkpoint``, up to
``trainer.total_training_steps`` (or ``--steps``): the trainer's model, AdamW
state, queued samples, unfinished groups and counters come back, every
replica is brought to the checkpoint's weight version before anything is
generated, and the run directory's files are appended to (see
:mod:`launcher.train_job`). It is refused (exit 2, one line) when
``RUN_DIR`` has no checkpoint, when the config's model, task or group size
differ from the checkpoint's, or when the run already reached the requested
steps. Without ``--resume`` a run directory holding an earlier run is refused.

The module stays import-light (``rollmesh --help`` imports it to build the
parser); the job itself lives in :mod:`launcher.train_job`. A config that
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .job_config import JobConfig

HELP = "train on a local mesh (controller, balancer, replica agents, trainer agent) and summarise the run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="job YAML (see examples/quickstart.yaml; keys as in the reference)")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="directory for events, metrics, spans, logs and the picture (default: runs/<config name>-<time>)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the interrupted or finished-early run in RUN_DIR from its checkpoint, "
                             "appending to its files (the config's model and task must be the checkpoint's)")
    parser.add_argument("--steps", type=int, metavar="N", help="override trainer.total_training_steps")
    parser.add_argument("--seed", type=int, metavar="N", help="override seed (model initialisation)")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    from mesh_runtime.config import ConfigError  # noqa: PLC0415
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
    from launcher.cli import print_config_notes  # noqa: PLC0415

    print_config_notes("train", job, sys.stdout)
    if args.resume is not None:
        return _resume(args, job, env)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Resolved once, here: every config the launcher writes names its files by absolute path, since a relative
    # path in a config file is read against that file's own directory.
    run_dir = Path(args.run_dir or Path("runs") / f"{Path(args.config).stem}-{stamp}").resolve()
    if (run_dir / "checkpoint").exists() or (run_dir / "events.jsonl").exists():
        print(f"rollmesh train: error: run directory {run_dir} holds an earlier run; pass a new --run-dir, "
              f"remove it, or continue it with --resume {run_dir}", file=sys.stderr)
        return 2
    return asyncio.run(_main(job, run_dir, env))


def _resume(args: argparse.Namespace, job: JobConfig, env: dict[str, str]) -> int:
    from .job_config import resume_problem  # noqa: PLC0415

    run_dir = Path(args.resume).resolve()
    if args.run_dir is not None and Path(args.run_dir).resolve() != run_dir.resolve():
        print(f"rollmesh train: error: --run-dir {args.run_dir} and --resume {args.resume} name different "
              "directories; a resumed run continues in RUN_DIR", file=sys.stderr)
        return 2
    info = None
    if (run_dir / "checkpoint").is_dir():
        from trainer_agent.driver.checkpoint import checkpoint_info  # noqa: PLC0415 - imports torch

        try:
            info = checkpoint_info(run_dir / "checkpoint")
        except ValueError as err:
            print(f"rollmesh train: error: {err}", file=sys.stderr)
            return 2
    problem = resume_problem(job, info, run_dir)
    if problem is not None:
        print(f"rollmesh train: error: cannot resume: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(_main(job, run_dir, env, resume=info))


async def _main(job: JobConfig, run_dir: Path, env: dict[str, str], resume: Any = None) -> int:
    from .train_job import TrainJob  # noqa: PLC0415

    runner = TrainJob(job, run_dir, env, resume=resume)
    task = asyncio.create_task(runner.run())
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []
    interrupted = False

    def at_once() -> None:
        nonlocal interrupted
        if runner.ending:   # cancelling now would leave processes running; they are being stopped
            print("\nrollmesh train: the run is ending; waiting for its processes to stop", file=sys.stderr,
                  flush=True)
        elif not interrupted:
            interrupted = True
            print("\nrollmesh train: interrupted; stopping every process", file=sys.stderr, flush=True)
            task.cancel()

    async def after_this_step() -> None:
        try:
            final = await runner.stop_training()
        except Exception as err:  # noqa: BLE001 - any refusal falls back to stopping at once
            detail = err.details() if hasattr(err, "details") else str(err)
            print(f"\nrollmesh train: cannot end after this step ({detail}); stopping at once", file=sys.stderr,
                  flush=True)
            at_once()
            return
        print(f"\nrollmesh train: ending after step {final} (checkpoint and model written as at a normal end); "
              "Ctrl-C again stops at once", file=sys.stderr, flush=True)

    def on_sigint() -> None:
        # the first Ctrl-C ends the run cleanly after its current step; the second (or SIGTERM) stops at once
        if stopping or interrupted:
            at_once()
        else:
            stopping.append(asyncio.create_task(after_this_step()))

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, at_once)
    try:
        return await task
    except asyncio.CancelledError:
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for pending in stopping:
            pending.cancel()
