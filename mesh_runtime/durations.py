"""Seconds to and from ``google.protobuf.Duration`` and ``Timestamp``: the one place that converts them.

Both messages carry ``seconds`` and ``nanos``; rollmesh's code keeps times as float seconds (durations, and
``time.time()`` for wall-clock instants). A duration is never negative here: a negative number of seconds
becomes zero, as a deadline already passed.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf import duration_pb2, timestamp_pb2

T = TypeVar("T", duration_pb2.Duration, timestamp_pb2.Timestamp)


def to_seconds(value: duration_pb2.Duration | timestamp_pb2.Timestamp) -> float:
    """The message as float seconds (a Timestamp: since the epoch)."""
    return value.seconds + value.nanos / 1e9


def set_seconds(message: T, seconds: float) -> T:
    """Fill ``message`` (a field of a message, or a new one) from float seconds; returns it."""
    if isinstance(message, duration_pb2.Duration):
        seconds = max(0.0, seconds)
    message.FromNanoseconds(int(seconds * 1e9))
    return message


def duration(seconds: float | None) -> duration_pb2.Duration:
    """A Duration of ``seconds`` (None: zero)."""
    return set_seconds(duration_pb2.Duration(), seconds or 0.0)


def timestamp(seconds: float | None) -> timestamp_pb2.Timestamp:
    """A Timestamp ``seconds`` after the epoch (None or 0: unset, the empty message)."""
    return set_seconds(timestamp_pb2.Timestamp(), seconds) if seconds else timestamp_pb2.Timestamp()
