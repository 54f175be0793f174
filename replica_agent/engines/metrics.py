"""Sliding-window latency and throughput metrics behind ``LoadSnapshot``.

Every sample is time-stamped with the engine's clock and forgotten after
``window_s`` seconds (and beyond ``max_samples``), so the figures describe
recent load rather than the engine's whole life.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


class _Window:
    """Time-stamped samples younger than ``window_s``, at most ``max_samples``."""

    def __init__(self, window_s: float, max_samples: int) -> None:
        self._window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))

    def values(self, now: float) -> list[float]:
        horizon = now - self._window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return [v for _, v in self._samples]


class EngineMetrics:
    """Records per-request latencies and emitted tokens.

    ``queue time`` is submit -> admission into the running batch, ``TTFT`` is
    submit -> first new token, ``ITL`` is the gap between consecutive new
    tokens of one request, and tokens/s counts completion tokens emitted in
    the last ``rate_window_s`` seconds (or since creation, if younger).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        window_s: float = 60.0,
        rate_window_s: float = 10.0,
        max_samples: int = 4096,
    ) -> None:
        self._clock = clock
        self._created = clock()
        self._rate_window_s = rate_window_s
        self._queue = _Window(window_s, max_samples)
        self._ttft = _Window(window_s, max_samples)
        self._itl = _Window(window_s, max_samples)
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()

    def record_queue_time(self, seconds: float) -> None:
        self._queue.add(self._clock(), seconds)

    def record_ttft(self, seconds: float) -> None:
        self._ttft.add(self._clock(), seconds)

    def record_itl(self, seconds: float) -> None:
        self._itl.add(self._clock(), seconds)

    def record_tokens(self, count: int) -> None:
        if count > 0:
            self._tokens.append((self._clock(), count))

    def tokens_per_second(self) -> float:
        now = self._clock()
        horizon = now - self._rate_window_s
        while self._tokens and self._tokens[0][0] < horizon:
            self._tokens.popleft()
        span = min(self._rate_window_s, now - self._created)
        if span <= 0:
            return 0.0
        return sum(n for _, n in self._tokens) / span

    def queue_time_p95(self) -> float:
        return percentile(self._queue.values(self._clock()), 95)

    def ttft_p95(self) -> float:
        return percentile(self._ttft.values(self._clock()), 95)

    def itl_stats(self) -> tuple[float, float]:
        """(mean, p95) of recent inter-token latencies."""
        values = self._itl.values(self._clock())
        if not values:
            return 0.0, 0.0
        return sum(values) / len(values), percentile(values, 95)
