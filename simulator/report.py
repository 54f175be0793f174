"""Results of a scenario: the section-5 table, JSON and the reference's figures as PNG.

``speedup`` follows the reference's wording ("reduces total wall-clock
training time by ~15.3%"): ``1 - T_dynamic / T_static``.

The bottleneck of a run is read off its steady state (the first 10% of the
steps are skipped) the way section 5 reads it off ``mq_size``:

* production (rollout): the trainer waits for samples in its mini-batches
  for more than 10% of the step and ``mq_size`` stays below one mini-batch
  (``required_samples``), so every step starts starved;
* consumption (trainer): the trainer (almost) never waits and ``mq_size``
  stays at >= 90% of its cap ``floor(step_samples x staleness_threshold)``,
  the most the staleness budget lets remain queued after a step;
* matched: neither.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .run import RunResult
from .scenario import Scenario


def steady(result: RunResult) -> int:
    """Steps skipped as warm-up when averaging."""
    return max(1, len(result.steps) // 10)


def bottleneck(result: RunResult, required_samples: int) -> str:
    skip = steady(result)
    steps = result.steps[skip:] or result.steps
    step_time = sum(s.duration_s for s in steps)
    stall_share = sum(s.stall_s for s in steps) / step_time if step_time else 0.0
    mq = sum(s.mq_size for s in steps) / len(steps)
    if stall_share > 0.10 and mq < required_samples:
        return "production (rollout)"
    if stall_share < 0.02 and mq >= 0.9 * result.queue_cap:
        return "consumption (trainer)"
    return "matched"


def summary_row(result: RunResult, required_samples: int) -> dict[str, Any]:
    skip = steady(result)
    steps = result.steps[skip:] or result.steps
    step_time = sum(s.duration_s for s in steps)
    return {
        "config": result.name, "policy": result.policy, "train_gpus": result.train_gpus,
        "rollout_gpus": result.rollout_gpus, "dynamic": result.dynamic, "steps": len(result.steps),
        "total_time_s": round(result.total_time_s, 3),
        "mean_step_s": round(result.total_time_s / max(1, len(result.steps)), 3),
        "bottleneck": bottleneck(result, required_samples),
        "mq_size_mean": round(result.mean("mq_size", skip), 2), "mq_cap": result.queue_cap,
        "trainer_wait_share": round(sum(s.stall_s for s in steps) / step_time, 4) if step_time else 0.0,
        "rollout_utilization_mean": round(result.mean("rollout_utilization", skip), 4),
        "train_utilization_mean": round(result.mean("train_utilization", skip), 4),
        "resource_utilization_mean": round(result.mean("resource_utilization", skip), 4),
        "activations": result.activations, "deactivations": result.deactivations,
        "dropped_samples": result.dropped,
    }


def speedups(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """``1 - T_dynamic / T_static`` for every dynamic run against every static run."""
    rows = []
    for dyn in (r for r in results if r.dynamic):
        for static in (r for r in results if not r.dynamic):
            rows.append({"dynamic": dyn.name, "static": static.name,
                         "speedup": round(1.0 - dyn.total_time_s / static.total_time_s, 4)})
    return rows


def scenario_report(scenario: Scenario, results: Sequence[RunResult], *, wall_s: float) -> dict[str, Any]:
    required = scenario.workload.required_samples
    return {
        "scenario": scenario.name, "description": scenario.description, "source": scenario.source,
        "seed": scenario.seed, "steps": len(results[0].steps) if results else 0,
        "required_samples": required, "step_samples": scenario.workload.step_samples,
        "table": [summary_row(r, required) for r in results],
        "speedups": speedups(results),
        "reference_speedups": {"vs 8+24 static": 0.153, "vs 16+16 static": 0.175},
        "simulation_wall_s": round(wall_s, 3),
        "runs": {r.name: r.to_dict() for r in results},
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"scenario {report['scenario']}: {report['steps']} steps, simulated in "
             f"{report['simulation_wall_s']:.2f} s",
             f"{'config':<16}{'total time':>12}{'step':>9}  {'bottleneck':<23}{'mq (cap)':>12}"
             f"{'rollout':>9}{'train':>7}{'cluster':>9}"]
    for row in report["table"]:
        lines.append(f"{row['config']:<16}{row['total_time_s']:>11.0f}s{row['mean_step_s']:>8.1f}s  "
                     f"{row['bottleneck']:<23}{row['mq_size_mean']:>6.0f} ({row['mq_cap']:>3})"
                     f"{row['rollout_utilization_mean']:>9.2f}{row['train_utilization_mean']:>7.2f}"
                     f"{row['resource_utilization_mean']:>9.2f}")
    for row in report["speedups"]:
        lines.append(f"speedup of {row['dynamic']} vs {row['static']}: {row['speedup'] * 100:.1f}%")
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


FIGURES = (
    ("step_time.png", "duration_s", "Per-step runtime (s)"),
    ("mq_size.png", "mq_size", "dynamic_resource/mq_size (samples)"),
    ("resource_utilization.png", "resource_utilization", "dynamic_resource/resource_utilization"),
    ("rollout_resource_utilization.png", "rollout_utilization", "dynamic_resource/rollout_resource_utilization"),
    ("train_resource_utilization.png", "train_utilization", "dynamic_resource/train_resource_utilization"),
)


def write_plots(out: Path, results: Sequence[RunResult], title: str) -> list[Path]:
    """One PNG per figure of the reference's section 5, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for filename, attr, label in FIGURES:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for result in results:
            values = [s.duration_s if attr == "duration_s" else getattr(s, attr) for s in result.steps]
            ax.plot([s.step for s in result.steps], values, label=result.name, linewidth=1.2)
        if attr == "mq_size" and results:
            ax.axhline(results[0].queue_cap, color="grey", linestyle="--", linewidth=0.8, label="cap")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / filename
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def write_sweep_plot(out: Path, sweep: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w["workload"] for w in sweep["workloads"]]
    policies = sweep["policies"]
    fig, ax = plt.subplots(figsize=(max(7, len(workloads) * 1.1), 4.8), dpi=100)
    width = 0.8 / max(1, len(policies))
    lowest = 1.0
    for k, policy in enumerate(policies):
        values = [w["fraction_of_oracle"].get(policy, 0.0) for w in sweep["workloads"]]
        lowest = min([lowest, *values])
        ax.bar([i + k * width for i in range(len(workloads))], values, width, label=policy)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("oracle time / policy time")
    ax.set_ylim(max(0.0, min(0.8, lowest - 0.05)), 1.02)
    ax.set_title(f"policy sweep ({sweep['steps']} steps per run): fraction of the oracle", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=min(3, len(policies)))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path)
    plt.close(fig)
    return path
