"""``rollmesh simulate``: run a scenario on the virtual clock and write its tables and figures.

Kept import-light: the simulator, the controller core and matplotlib are
imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys

HELP = "simulate a scenario (static vs dynamic splits, policy sweep) with the real controller core"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", required=True, metavar="NAME|FILE",
                        help="built-in scenario name (reference-32gpu, tiny) or a scenario YAML file")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for results.json and the PNGs")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the scenario's)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the response-length trace")
    parser.add_argument("--policy", default=None, metavar="NAME|module:Class",
                        help="policy for the dynamic runs (default: scheduling.dynamic_schedule_policy)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the scenario's policy sweep with the oracle search (sweep.json, sweep.png); "
                             "its steps per run come from the scenario's sweep section")
    parser.add_argument("--no-plots", action="store_true", help="write JSON only")


def run(args: argparse.Namespace, env: dict[str, str]) -> int:
    import os
    import time
    from pathlib import Path

    if os.getcwd() not in sys.path:   # so that --policy my_module:MyPolicy finds the user's module
        sys.path.insert(0, os.getcwd())
    from .scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
        if args.steps is not None and args.steps < 1:
            raise ScenarioError("--steps", f"must be >= 1, got {args.steps}")
        if args.policy is not None:
            scenario = scenario.with_overrides({"scheduling.dynamic_schedule_policy": args.policy})
        if args.seed is not None:
            scenario = scenario.with_overrides({"seed": args.seed})
        if args.compare and scenario.sweep is None:
            raise ScenarioError("sweep", f"--compare needs a sweep section in scenario {scenario.name!r}")
    except ScenarioError as err:
        print(f"rollmesh simulate: error: {err}", file=sys.stderr)
        return 2

    from .compare import compare_policies, format_sweep, sweep_from_scenario
    from .report import format_table, scenario_report, write_json, write_plots, write_sweep_plot
    from .run import simulate_run
    from .vloop import SimulationStalled

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        results = [simulate_run(scenario, spec, steps=args.steps) for spec in scenario.runs]
    except ScenarioError as err:
        print(f"rollmesh simulate: error: {err}", file=sys.stderr)
        return 2
    except SimulationStalled as err:
        print(f"rollmesh simulate: error: {err}", file=sys.stderr)
        return 1
    report = scenario_report(scenario, results, wall_s=time.perf_counter() - started)
    write_json(out / "results.json", report)
    print(format_table(report))
    if not args.no_plots:
        for path in write_plots(out, results, scenario.name):
            print(f"wrote {path}")
    print(f"wrote {out / 'results.json'}")
    if args.compare:
        policies, workloads, steps, oracle = sweep_from_scenario(scenario)
        sweep = compare_policies(scenario, policies, workloads, steps=steps, oracle=oracle,
                                 progress=lambda row: print(f"  swept {row['workload']}", flush=True))
        write_json(out / "sweep.json", sweep)
        print(format_sweep(sweep))
        if not args.no_plots and oracle:
            print(f"wrote {write_sweep_plot(out, sweep)}")
        print(f"wrote {out / 'sweep.json'}")
    return 0
