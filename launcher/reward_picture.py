"""``reward.png``: the run's mean reward per global step, with the steps that activated the hybrid replicas
marked, next to ``resource_time.png``; a multi-turn run adds the model turns and tool calls per trajectory
(right axis). matplotlib is imported only when drawing."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def reward_series(steps: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float], list[int]]:
    """``(global steps, mean rewards, steps that activated the hybrid replicas)`` of the trainer's step lines."""
    xs, ys, activated = [], [], []
    for step in steps:
        xs.append(int(step["global_step"]))
        ys.append(float(step["reward_mean"]))
        if step.get("hybrid_activated"):
            activated.append(int(step["global_step"]))
    return xs, ys, activated


def turn_series(steps: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Per step, the mean model turns and tool calls per trajectory of a multi-turn run (empty otherwise)."""
    keys = {"turns": "multi_turn/assistant_turns/mean", "tool_calls": "multi_turn/tool_calls/mean"}
    if not any(keys["turns"] in (step.get("samples") or {}) for step in steps):
        return {}
    return {name: [float((step.get("samples") or {}).get(key, 1.0 if name == "turns" else 0.0)) for step in steps]
            for name, key in keys.items()}


def render_reward_picture(steps: Sequence[Mapping[str, Any]], out_path: str, *, title: str = "") -> None:
    """Draw the curve (PNG); the series are kept in the file's ``rollmesh:reward`` text chunk."""
    import matplotlib  # noqa: PLC0415 - only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    xs, ys, activated = reward_series(steps)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    ax.plot(xs, ys, color="#1f77b4", marker="o", markersize=3, linewidth=1.5, label="mean reward")
    hits = [y for x, y in zip(xs, ys) if x in set(activated)]
    if activated:
        ax.scatter(activated, hits, marker="^", color="#d62728", zorder=3, s=28,
                   label="hybrid replicas activated after this step")
    ax.set_xlabel("global step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02 if not ys or max(ys) <= 1 else max(ys) * 1.05)
    ax.grid(alpha=0.3)
    turns = turn_series(steps)
    if turns:
        right = ax.twinx()
        right.plot(xs, turns["turns"], color="#2ca02c", linewidth=1.2, label="model turns per trajectory")
        right.plot(xs, turns["tool_calls"], color="#ff7f0e", linewidth=1.2, linestyle="--",
                   label="tool calls per trajectory")
        right.set_ylabel("per trajectory")
        right.set_ylim(0, max(2.0, max(turns["turns"]) * 1.1))
        right.legend(loc="center right", fontsize=8)
    ax.legend(loc="lower right", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, metadata={"rollmesh:reward": json.dumps({"steps": xs, "reward": ys,
                                                                   "hybrid_activated": activated, **turns})})
    plt.close(fig)
