"""Simulator speed and the reference-scenario and sweep tables.

    .venv/bin/python benchmarks/bench_simulator.py [--steps 200] [--sweep] [--repeat 3]

Prints the wall time of simulating ``--steps`` steps of each run of the
32-GPU reference scenario (the target: 200 steps of one run in <= 10 s on a
2-core machine), then the section-5 table with the speedups next to the
reference's 15.3% / 17.5%, and with ``--sweep`` the policy sweep against the
oracle.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simulator.compare import compare_policies, format_sweep, sweep_from_scenario  # noqa: E402
from simulator.report import format_table, scenario_report  # noqa: E402
from simulator.run import simulate_run  # noqa: E402
from simulator.scenario import load_scenario  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="reference-32gpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions of each run (best is reported)")
    parser.add_argument("--sweep", action="store_true", help="also run the policy sweep with the oracle")
    args = parser.parse_args()

    scenario = load_scenario(args.scenario)
    results = []
    total = 0.0
    print(f"simulating {args.steps} steps of {scenario.name} ({scenario.total_gpus} GPUs), best of {args.repeat}:")
    for spec in scenario.runs:
        best = float("inf")
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = simulate_run(scenario, spec, steps=args.steps)
            best = min(best, time.perf_counter() - started)
        total += best
        results.append(result)
        print(f"  {spec.name:<16} {best:6.2f} s wall for {args.steps} steps "
              f"({result.generated} samples, {result.total_time_s / 3600:.1f} simulated hours)")
    print(f"  all runs: {total:.2f} s")
    print()
    print(format_table(scenario_report(scenario, results, wall_s=total)))
    print("reference (section 5): 15.3% vs 8+24 static, 17.5% vs 16+16 static")
    if args.sweep:
        policies, workloads, steps, oracle = sweep_from_scenario(scenario)
        sweep = compare_policies(scenario, policies, workloads, steps=steps, oracle=oracle)
        print()
        print(format_sweep(sweep))
        print(f"sweep wall time: {sweep['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
