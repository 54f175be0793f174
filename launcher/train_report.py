"""What ``rollmesh train`` prints and saves: transition lines, the progress bar and the summary.

Pure functions over plain data: lifecycle events as dicts of
``controller.core.events.LifecycleEvent``'s fields (the lines of
``events.jsonl``), the trainer's step lines (``trainer/steps.jsonl``), the
controller's metrics cycles (GetMetrics) and the trainer's final progress.
Every count in the summary is computed here from those records, so a test
can recompute it by hand from the run directory.

A resumed run (``rollmesh train --resume``) appends to the same files:
``steps.jsonl`` gets a ``resumed`` line (the checkpoint's step ``k``, which
supersedes any step line above ``k`` the interrupted run wrote after its last
checkpoint; :func:`effective_steps` applies it) and the steps after it. The
summary's steps and rewards cover the whole run from step 1; its sample
counts are the trainer's, continuous with the checkpoint's; its transitions
and metrics cover only the resumed part (the controller of the new mesh
starts afresh), and the table says so ("only since resume at step k").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_PREFIXES = ("REPLICA_STATE_", "HYBRID_STATE_", "OPERATION_STATE_", "REPLICA_KIND_")


def _short(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def describe_event(event: Mapping[str, Any], t0: float) -> str:
    """One line for a lifecycle event: time since start, step, subject, transition, reason."""
    kind = event["type"]
    step = event.get("global_step")
    where = f"step {step:>3}" if step is not None else " " * 8
    subject = event.get("replica_id") or event.get("node_id") or "controller"
    attrs = event.get("attributes") or {}
    if event.get("from_state") or event.get("to_state"):
        what = f"{_short(event.get('from_state') or '?')} -> {_short(event.get('to_state') or '?')}"
    elif kind == "STEP_PHASE":
        what = f"{attrs.get('phase', '')}" + "".join(f" {k}={v}" for k, v in sorted(attrs.items())
                                                      if k in ("deactivate", "wait_samples", "released",
                                                               "activated", "hybrid_sync_skipped"))
    elif kind.startswith("WEIGHT_SYNC"):
        version = event.get("weight_version")
        detail = attrs.get("bytes_sent") or attrs.get("bytes_saved")
        what = f"v{version}" + (f" role={attrs['role']}" if "role" in attrs else "") + (
            f" bytes={detail}" if detail else "")
    else:
        what = ""
    reason = event.get("reason") or ""
    return f"  +{event['time'] - t0:7.1f}s  {where}  {kind:<24} {subject:<12} {what}" + (
        f"  ({reason})" if reason and kind != "STEP_PHASE" else "")


def progress_bar(step: int, total: int, *, reward: float | None, queue: int, state: str, width: int = 24) -> str:
    done = min(width, int(width * step / max(1, total)))
    bar = "#" * done + "." * (width - done)
    shown = "  -  " if reward is None else f"{reward:5.3f}"
    return f"[{bar}] step {step}/{total}  reward {shown}  queue {queue:<4} {state.lower().replace('_', ' ')}"


def count_transitions(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Activations, deactivations, weight syncs and skipped hybrid syncs, with their bytes, from events."""
    out = {"activations": 0, "deactivations": 0, "weight_syncs": 0, "weight_sync_bytes": 0,
           "skipped_hybrid_syncs": 0, "bytes_saved": 0, "weight_sync_failures": 0, "wait_expired": 0}
    for e in events:
        kind, attrs = e["type"], e.get("attributes") or {}
        if kind == "CONTROLLER_STATE_CHANGED" and e.get("from_state"):
            if e.get("to_state") == "HYBRID_STATE_HYBRID_ACTIVE":
                out["activations"] += 1
            elif e.get("to_state") == "HYBRID_STATE_STANDALONE_ONLY":
                out["deactivations"] += 1
        elif kind == "WEIGHT_SYNC_COMPLETED":
            out["weight_syncs"] += 1
            out["weight_sync_bytes"] += int(attrs.get("bytes_sent", 0))
        elif kind == "WEIGHT_SYNC_SKIPPED":
            out["skipped_hybrid_syncs"] += 1
            out["bytes_saved"] += int(attrs.get("bytes_saved", 0))
        elif kind == "WEIGHT_SYNC_FAILED":
            out["weight_sync_failures"] += 1
        elif kind == "WAIT_EXPIRED":
            out["wait_expired"] += 1
    return out


def metric_summary(cycles: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """For each metric of the closed sync cycles: its mean over the cycles and its last value."""
    keys = sorted({k for c in cycles for k in c.get("values", {})})
    out = {}
    for key in keys:
        values = [float(c["values"][key]) for c in cycles if key in c.get("values", {})]
        out[key] = {"mean": sum(values) / len(values), "last": values[-1], "cycles": len(values)}
    return out


def reward_summary(steps: Sequence[Mapping[str, Any]], window: int = 3) -> dict[str, float]:
    rewards = [float(s["reward_mean"]) for s in steps]
    if not rewards:
        return {}
    k = max(1, min(window, len(rewards) // 2 or 1))
    return {"first": rewards[0], "last": rewards[-1], "first_mean": sum(rewards[:k]) / k,
            "last_mean": sum(rewards[-k:]) / k, "window": k, "max": max(rewards)}


def effective_steps(lines: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The step lines of ``steps.jsonl`` that stand, in order, across resumes.

    A ``resumed`` line with ``global_step`` k drops the step lines above k
    written before it (the interrupted run got past its last checkpoint):
    the resumed run does those steps again.
    """
    steps: list[Mapping[str, Any]] = []
    for line in lines:
        if line.get("event") == "resumed":
            steps = [s for s in steps if int(s["global_step"]) <= int(line["global_step"])]
        elif line.get("event") == "step":
            steps.append(line)
    return steps


def summarize(*, events: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]],
              cycles: Sequence[Mapping[str, Any]], progress: Mapping[str, Any], wall_s: float,
              total_steps: int, resumed_at_step: int | None = None) -> dict[str, Any]:
    """The run's summary (what ``metrics.json`` holds under ``summary``).

    ``resumed_at_step``: the checkpoint step this invocation resumed from
    (None for a fresh run); ``events`` and ``cycles`` are then this
    invocation's only, while ``steps`` are the whole run's.
    """
    return {
        "wall_s": wall_s, "steps": len(steps), "total_training_steps": total_steps,
        "resumed_at_step": resumed_at_step,
        "reward": reward_summary(steps),
        "samples": {k: int(progress.get(k, 0)) for k in ("samples_generated", "samples_consumed",
                                                          "samples_dropped", "queue_size")},
        "transitions": count_transitions(events),
        "metrics": metric_summary(cycles),
        "final_weight_version": int(progress.get("weight_version", 0)),
        "state": progress.get("state", ""),
        # the step a StopTraining call (Ctrl-C) ended the run after; None when it ran all its steps
        "stopped_after_step": stopped if 0 < (stopped := int(progress.get("final_step", 0))) < total_steps else None,
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """The table printed at the end of a run."""
    r, s, t = summary["reward"], summary["samples"], summary["transitions"]
    resumed = summary.get("resumed_at_step")
    rows: list[tuple[str, str]] = [
        ("wall time" if resumed is None else "wall time since resume", f"{summary['wall_s']:.1f} s"),
        ("steps", f"{summary['steps']} / {summary['total_training_steps']} (final weight version "
                  f"{summary['final_weight_version']})"),
    ]
    if summary.get("stopped_after_step") is not None:
        rows.append(("stopped early", f"after step {summary['stopped_after_step']} (StopTraining)"))
    if r:
        rows += [("reward, step 1 -> last", f"{r['first']:.3f} -> {r['last']:.3f}"),
                 (f"reward, mean of first/last {r['window']}", f"{r['first_mean']:.3f} -> {r['last_mean']:.3f}")]
    rows += [
        ("samples generated", str(s["samples_generated"])),
        ("samples consumed", str(s["samples_consumed"])),
        ("samples dropped", str(s["samples_dropped"])),
        ("samples left in queue", str(s["queue_size"])),
    ]
    if resumed is not None:
        rows.append(("rows below count", f"only since resume at step {resumed} (a new mesh, a new event log)"))
    rows += [
        ("hybrid activations", str(t["activations"])),
        ("hybrid deactivations", str(t["deactivations"])),
        ("weight syncs", f"{t['weight_syncs']} ({t['weight_sync_bytes']:,} bytes)"),
        ("skipped hybrid syncs", f"{t['skipped_hybrid_syncs']} ({t['bytes_saved']:,} bytes saved)"),
    ]
    if t["weight_sync_failures"] or t["wait_expired"]:
        rows.append(("failed syncs / expired waits", f"{t['weight_sync_failures']} / {t['wait_expired']}"))
    for key, value in summary["metrics"].items():
        rows.append((key, f"mean {value['mean']:.3f}, last {value['last']:.3f}"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])
