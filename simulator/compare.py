"""Policy comparison over a sweep of workloads, against the oracle.

Each sweep workload is the scenario with some fields overridden (response
length mix, trainer/rollout speed ratio, cluster split). On it every policy
of ``sweep.policies`` (registered names or ``package.module:Class`` paths,
created by the controller core's registry) runs the scenario's first dynamic
run, and the oracle search (:mod:`simulator.oracle`) finds the best schedule
in hindsight on the same trace. Reported per workload: each policy's total
time and ``fraction_of_oracle = oracle time / policy time``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .oracle import ScheduledPolicy, search_oracle
from .run import simulate_run
from .scenario import RunSpec, Scenario, ScenarioError, SweepWorkload

SPLIT_KEYS = ("train_gpus", "rollout_gpus")


def dynamic_run(scenario: Scenario) -> RunSpec:
    for spec in scenario.runs:
        if spec.dynamic:
            return spec
    raise ScenarioError("runs", "a policy comparison needs a run with dynamic: true")


def workload_scenario(scenario: Scenario, workload: SweepWorkload) -> tuple[Scenario, RunSpec]:
    """The scenario and dynamic run of one sweep workload (``train_gpus``/``rollout_gpus`` set the split)."""
    overrides = {k: v for k, v in workload.overrides.items() if k not in SPLIT_KEYS}
    base = dynamic_run(scenario)
    split = {k: workload.overrides[k] for k in SPLIT_KEYS if k in workload.overrides}
    raw_runs = [{"name": base.name, "train_gpus": split.get("train_gpus", base.train_gpus),
                 "rollout_gpus": split.get("rollout_gpus", base.rollout_gpus), "dynamic": True}]
    try:
        varied = scenario.with_overrides({**overrides, "runs": raw_runs, "sweep": None})
    except ScenarioError as err:
        raise ScenarioError(f"sweep.workloads[{workload.name}].{err.field}", str(err)) from None
    return varied, varied.runs[0]


def compare_policies(scenario: Scenario, policies: Sequence[str], workloads: Sequence[SweepWorkload], *,
                     steps: int, oracle: bool = True, progress: Any = None) -> dict[str, Any]:
    rows = []
    started = time.perf_counter()
    for workload in workloads:
        varied, spec = workload_scenario(scenario, workload)
        times = {p: simulate_run(varied, spec, steps=steps, policy=p).total_time_s for p in policies}
        row: dict[str, Any] = {"workload": workload.name, "overrides": dict(workload.overrides),
                               "split": f"{spec.train_gpus}+{spec.rollout_gpus}", "time_s": times}
        if oracle:
            result = search_oracle(
                lambda schedule: simulate_run(varied, spec, steps=steps,
                                              policy_instance=ScheduledPolicy(schedule)).total_time_s, steps)
            best = min(result.total_time_s, *times.values())
            row.update(oracle_time_s=result.total_time_s, oracle_schedule=result.schedule.describe(),
                       oracle_evaluations=result.evaluations,
                       fraction_of_oracle={p: result.total_time_s / t for p, t in times.items()},
                       fraction_of_best={p: best / t for p, t in times.items()})
        rows.append(row)
        if progress is not None:
            progress(row)
    summary = _summary(rows, policies, oracle)
    return {"scenario": scenario.name, "steps": steps, "policies": list(policies), "workloads": rows,
            "summary": summary, "wall_s": round(time.perf_counter() - started, 2)}


def _summary(rows: list[dict[str, Any]], policies: Sequence[str], oracle: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in policies:
        entry: dict[str, Any] = {"mean_time_s": sum(r["time_s"][p] for r in rows) / len(rows)}
        if oracle:
            fractions = [r["fraction_of_oracle"][p] for r in rows]
            entry["mean_fraction_of_oracle"] = sum(fractions) / len(fractions)
            entry["min_fraction_of_oracle"] = min(fractions)
        if "default" in policies and p != "default":
            ratios = [r["time_s"][p] / r["time_s"]["default"] - 1.0 for r in rows]
            entry["vs_default_mean"] = sum(ratios) / len(ratios)
            entry["vs_default_worst"] = max(ratios)
        out[p] = entry
    return out


def format_sweep(sweep: dict[str, Any]) -> str:
    policies = sweep["policies"]
    short = [p.rsplit(":", 1)[-1][:14] for p in policies]
    has_oracle = bool(sweep["workloads"]) and "oracle_time_s" in sweep["workloads"][0]
    head = f"{'workload':<18}{'split':>7}" + "".join(f"{s:>16}" for s in short) + (
        f"{'oracle':>10}" if has_oracle else "")
    lines = [f"policy sweep: {sweep['steps']} steps per run; time (fraction of oracle)", head]
    for row in sweep["workloads"]:
        cells = []
        for p in policies:
            frac = row.get("fraction_of_oracle", {}).get(p)
            cells.append(f"{row['time_s'][p]:>9.0f}" + (f" ({frac:.3f})" if frac is not None else ""))
        lines.append(f"{row['workload']:<18}{row['split']:>7}" + "".join(f"{c:>16}" for c in cells)
                     + (f"{row['oracle_time_s']:>10.0f}" if has_oracle else ""))
    summary = sweep["summary"]
    if has_oracle:
        lines.append(f"{'mean fraction':<25}" + "".join(
            f"{summary[p]['mean_fraction_of_oracle']:>16.3f}" for p in policies))
        lines.append(f"{'worst fraction':<25}" + "".join(
            f"{summary[p]['min_fraction_of_oracle']:>16.3f}" for p in policies))
    if "default" in policies:
        lines.append(f"{'vs default (mean)':<25}" + "".join(
            f"{summary[p].get('vs_default_mean', 0.0) * 100:>15.2f}%" for p in policies))
        lines.append(f"{'vs default (worst)':<25}" + "".join(
            f"{summary[p].get('vs_default_worst', 0.0) * 100:>15.2f}%" for p in policies))
    return "\n".join(lines)


def sweep_from_scenario(scenario: Scenario) -> tuple[list[str], list[SweepWorkload], int, bool]:
    if scenario.sweep is None:
        raise ScenarioError("sweep", f"scenario {scenario.name!r} has no sweep section")
    s = scenario.sweep
    workloads = list(s.workloads) or [SweepWorkload("base", {})]
    return list(s.policies), workloads, s.steps, s.oracle

