"""The resource-time picture: who did what, when, drawn from real lifecycle events.

One row per replica and one for the trainer; time runs left to right and
each step's start is marked, as in the figure of the reference's section 1.
A replica's row follows its ``REPLICA_STATE_CHANGED`` events (ACTIVE is
rollout, SYNCING is weight sync, SLEEPING is asleep, ...). The trainer's row
follows the step protocol's ``STEP_PHASE`` events and the weight-sync events:
from ``begin`` to ``release`` it waits for the samples the policy asked for
before the hybrid replicas are taken back, then it trains until the step's
weight sync starts, then it broadcasts. A step that keeps the hybrid replicas
asleep has no ``release``; the trainer's time from ``begin`` to the sync is
then drawn as training. Where the caller knows better (the trainer's own
timings), ``activities`` adds or overrides segments.

Events are dicts of the fields of ``controller.core.events.LifecycleEvent``,
its ``type`` by name (what the main job writes to ``events.jsonl``);
:func:`event_dict_from_proto` converts the gRPC message.
matplotlib is imported only when drawing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mesh_runtime.durations import to_seconds

TRAINER_ROW = "trainer"

# activity -> (legend label, colour)
ACTIVITIES: dict[str, tuple[str, str]] = {
    "rollout": ("rollout", "#2e9e4f"),
    "train": ("training", "#2f6fbf"),
    "wait": ("waiting for samples", "#f2d16b"),
    "weight_sync": ("weight sync", "#f08a24"),
    "sleep": ("asleep (offloaded)", "#b8b8b8"),
    "loading": ("loading", "#b39ddb"),
    "paused": ("paused", "#f5c38b"),
    "draining": ("draining", "#8d6e63"),
    "down": ("failed / stopped", "#d9534f"),
}

_STATE_ACTIVITY = {
    "REPLICA_STATE_ACTIVE": "rollout",
    "REPLICA_STATE_SYNCING": "weight_sync",
    "REPLICA_STATE_SLEEPING": "sleep",
    "REPLICA_STATE_LAUNCHING": "loading",
    "REPLICA_STATE_LOADING": "loading",
    "REPLICA_STATE_PAUSED": "paused",
    "REPLICA_STATE_DRAINING": "draining",
    "REPLICA_STATE_FAILED": "down",
    "REPLICA_STATE_STOPPED": None,
    "REPLICA_STATE_REMOVED": None,
}


@dataclasses.dataclass(frozen=True)
class Segment:
    row: str
    start: float
    end: float
    activity: str


@dataclasses.dataclass(frozen=True)
class Picture:
    """What was drawn: rows top to bottom, segments, step starts (seconds from ``origin``)."""

    rows: tuple[str, ...]
    segments: tuple[Segment, ...]
    step_starts: tuple[tuple[int, float], ...]
    origin: float
    duration: float

    def time_in(self, row: str, activity: str) -> float:
        return sum(s.end - s.start for s in self.segments if s.row == row and s.activity == activity)


def event_dict_from_proto(msg: Any) -> dict[str, Any]:
    """A ``rollmesh.controller.v1.LifecycleEvent`` as a dict of ``controller.core.events.LifecycleEvent``'s
    fields (the events.jsonl form)."""
    from mesh_runtime.json_values import from_struct  # noqa: PLC0415
    from rollmesh.common.v1 import types_pb2  # noqa: PLC0415
    from rollmesh.controller.v1 import events_pb2  # noqa: PLC0415

    name = events_pb2.EventType.Name(msg.type)
    kind = types_pb2.ReplicaKind.Name(msg.replica_kind) if msg.replica_kind else ""
    return {
        "sequence": msg.sequence,
        "time": to_seconds(msg.time),
        "type": name.removeprefix("EVENT_TYPE_"),
        "replica_id": msg.replica_id, "node_id": msg.node_id, "replica_kind": kind,
        "from_state": msg.from_state, "to_state": msg.to_state, "reason": msg.reason,
        "trace_id": msg.trace_id, "span_id": msg.span_id,
        "global_step": msg.global_step if msg.HasField("global_step") else None,
        "weight_version": msg.weight_version if msg.HasField("weight_version") else None,
        "operation_id": msg.operation_id, "attributes": dict(msg.attributes),
        "missed_events": msg.missed_events, "details": from_struct(msg.details),
    }



def read_events(path: str) -> list[dict[str, Any]]:
    """Events from an ``events.jsonl`` file (one dict per line)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_picture(events: Iterable[Mapping[str, Any]], *,
                  activities: Sequence[Mapping[str, Any]] = (), end_time: float | None = None) -> Picture:
    """Turn events (and optional explicit segments) into rows and segments; pure.

    ``activities`` items are ``{"row", "start", "end", "activity"}`` with
    absolute times on the events' clock; they replace what the events imply
    for their row over their time span.
    """
    evs = sorted((e for e in events if e.get("type") != "GAP"), key=lambda e: (e["time"], e.get("sequence", 0)))
    extra = [Segment(str(a["row"]), float(a["start"]), float(a["end"]), str(a["activity"])) for a in activities]
    for seg in extra:
        if seg.activity not in ACTIVITIES:
            raise ValueError(f"unknown activity {seg.activity!r} for row {seg.row!r}; "
                             f"known: {', '.join(ACTIVITIES)}")
    times = [e["time"] for e in evs] + [t for s in extra for t in (s.start, s.end)]
    if not times:
        raise ValueError("no events to draw: the run recorded no lifecycle events")
    origin = min(times)
    end = max(max(times), end_time if end_time is not None else origin)

    kinds: dict[str, str] = {}
    current: dict[str, tuple[str | None, float]] = {}
    segments: list[Segment] = []
    for e in evs:
        rid = e.get("replica_id") or ""
        if rid and e.get("replica_kind"):
            kinds.setdefault(rid, e["replica_kind"])
        if e["type"] != "REPLICA_STATE_CHANGED" or not rid:
            continue
        kinds.setdefault(rid, "")
        prev = current.get(rid)
        if prev is not None and prev[0] is not None:
            segments.append(Segment(rid, prev[1], e["time"], prev[0]))
        current[rid] = (_STATE_ACTIVITY.get(e.get("to_state", "")), e["time"])
    for rid, (activity, start) in current.items():
        if activity is not None:
            segments.append(Segment(rid, start, end, activity))

    segments.extend(_trainer_segments(evs))
    if extra:
        for seg in extra:
            segments = _carve(segments, seg.row, seg.start, seg.end)
        segments.extend(extra)
    segments = [s for s in segments if s.end > s.start]

    def order(rid: str) -> tuple[int, str]:
        return (0 if kinds.get(rid) == "REPLICA_KIND_STANDALONE" else 1 if kinds.get(rid) == "REPLICA_KIND_HYBRID"
                else 2, rid)

    replica_rows = sorted({rid for rid in kinds} | {s.row for s in segments if s.row != TRAINER_ROW}, key=order)
    rows = (*replica_rows, TRAINER_ROW)
    steps = sorted({(int(e["global_step"]), e["time"]) for e in evs
                    if e["type"] == "STEP_PHASE" and (e.get("attributes") or {}).get("phase") == "begin"
                    and e.get("global_step") is not None})
    rel = tuple(Segment(s.row, s.start - origin, s.end - origin, s.activity)
                for s in sorted(segments, key=lambda s: (rows.index(s.row), s.start)))
    return Picture(rows, rel, tuple((gs, t - origin) for gs, t in steps), origin, end - origin)


def _trainer_segments(evs: Sequence[Mapping[str, Any]]) -> list[Segment]:
    """The trainer's wait / train / weight-sync periods from the step protocol's events."""
    out: list[Segment] = []
    step_start: float | None = None
    mark: tuple[str, float] | None = None  # (activity, since)
    sync_start: float | None = None
    for e in evs:
        kind, t = e["type"], e["time"]
        phase = (e.get("attributes") or {}).get("phase")
        if kind == "STEP_PHASE" and phase == "begin":
            step_start = t
            deactivate = (e.get("attributes") or {}).get("deactivate") in ("true", True)
            mark = ("wait" if deactivate else "train", t)
        elif kind == "STEP_PHASE" and phase == "release" and mark is not None:
            out.append(Segment(TRAINER_ROW, mark[1], t, mark[0]))
            mark = ("train", t)
        elif kind == "WEIGHT_SYNC_STARTED" and step_start is not None and sync_start is None:
            if mark is not None:
                out.append(Segment(TRAINER_ROW, mark[1], t, mark[0]))
                mark = None
            sync_start = t
        elif kind in ("WEIGHT_SYNC_COMPLETED", "WEIGHT_SYNC_FAILED") and sync_start is not None \
                and not e.get("replica_id"):
            out.append(Segment(TRAINER_ROW, sync_start, t, "weight_sync"))
            sync_start = None
        elif kind == "STEP_PHASE" and phase == "complete":
            if mark is not None:
                out.append(Segment(TRAINER_ROW, mark[1], t, mark[0]))
            if sync_start is not None:
                out.append(Segment(TRAINER_ROW, sync_start, t, "weight_sync"))
            mark, sync_start, step_start = None, None, None
    return out


def _carve(segments: list[Segment], row: str, start: float, end: float) -> list[Segment]:
    """Remove ``[start, end)`` from ``row``'s segments."""
    out = []
    for s in segments:
        if s.row != row or s.end <= start or s.start >= end:
            out.append(s)
            continue
        if s.start < start:
            out.append(Segment(row, s.start, start, s.activity))
        if s.end > end:
            out.append(Segment(row, end, s.end, s.activity))
    return out


def render_resource_picture(events: Iterable[Mapping[str, Any]], out_path: str, *, title: str = "",
                            activities: Sequence[Mapping[str, Any]] = (),
                            end_time: float | None = None) -> Picture:
    """Draw the picture as a PNG at ``out_path`` and return what was drawn.

    The PNG carries its row names top to bottom as JSON in the text chunk
    ``rollmesh:rows``, so a reader can check the rows without parsing pixels.
    """
    picture = build_picture(events, activities=activities, end_time=end_time)
    import matplotlib  # noqa: PLC0415 - only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    n = len(picture.rows)
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.45 * n), dpi=100)
    try:
        y_of = {row: n - 1 - i for i, row in enumerate(picture.rows)}
        used: list[str] = []
        for activity in ACTIVITIES:
            bars = [(s.start, s.end - s.start) for s in picture.segments if s.activity == activity]
            for row in picture.rows:
                row_bars = [(s.start, s.end - s.start) for s in picture.segments
                            if s.activity == activity and s.row == row]
                if row_bars:
                    ax.broken_barh(row_bars, (y_of[row] - 0.38, 0.76), facecolors=ACTIVITIES[activity][1],
                                   edgecolor="none")
            if bars:
                used.append(activity)
        for gs, t in picture.step_starts:
            ax.axvline(t, color="#444444", linewidth=0.6, linestyle=":")
            ax.text(t, n - 0.45, f"s{gs}", fontsize=7, ha="left", va="bottom", color="#444444")
        ax.set_yticks(range(n))
        ax.set_yticklabels(list(reversed(picture.rows)), fontsize=8)
        ax.set_ylim(-0.6, n - 0.1 + 0.3)
        ax.set_xlim(0, max(picture.duration, 1e-3))
        ax.set_xlabel("seconds since the first event")
        ax.set_title(title or "rollmesh: resource time per replica and trainer", fontsize=10)
        ax.legend(handles=[Patch(color=ACTIVITIES[a][1], label=ACTIVITIES[a][0]) for a in used],
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(out_path, format="png", metadata={"rollmesh:rows": json.dumps(list(picture.rows))})
    finally:
        plt.close(fig)
    return picture
