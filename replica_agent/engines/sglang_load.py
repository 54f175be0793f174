"""An SGLang server's load, read from its Prometheus ``/metrics``.

SGLang (``--enable-metrics``) exports, per model, the gauges
``sglang:num_running_reqs``, ``sglang:num_queue_reqs`` and
``sglang:token_usage`` (share of KV tokens in use) and the histograms
``sglang:queue_time_seconds`` and ``sglang:time_to_first_token_seconds``
(``python/sglang/srt/metrics/collector.py``). The percentiles here come from
the histogram buckets observed between two reads, so they describe recent
requests, not the server's whole life; with no new observation they keep
their last value.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

QUEUE_TIME = "sglang:queue_time_seconds"
TTFT = "sglang:time_to_first_token_seconds"


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of cumulative ``(upper_bound, count)`` buckets, interpolated within a bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


class ServerLoad:
    """The latest figures of one server (summed over its label sets, e.g. data-parallel ranks)."""

    def __init__(self) -> None:
        self.scraped = False
        self.running = 0
        self.waiting = 0
        self.token_usage = 0.0
        self.max_total_tokens = 0
        self.queue_time_p95 = 0.0
        self.ttft_p95 = 0.0
        self._last: dict[str, list[tuple[float, float]]] = {}

    def update(self, text: str) -> None:
        """Take one ``/metrics`` page. Raises ``ValueError`` for text that is not Prometheus exposition."""
        gauges: dict[str, float] = {}
        histograms: dict[str, dict[float, float]] = {}
        usage: list[float] = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("sglang:num_running_reqs", "sglang:num_queue_reqs"):
                    gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value
                elif sample.name == "sglang:token_usage":
                    usage.append(sample.value)
                elif sample.name in (QUEUE_TIME + "_bucket", TTFT + "_bucket"):
                    bound = float(sample.labels.get("le", "+Inf"))
                    per = histograms.setdefault(sample.name.removesuffix("_bucket"), {})
                    per[bound] = per.get(bound, 0.0) + sample.value
        self.running = int(gauges.get("sglang:num_running_reqs", 0))
        self.waiting = int(gauges.get("sglang:num_queue_reqs", 0))
        self.token_usage = min(1.0, max(0.0, sum(usage) / len(usage))) if usage else 0.0
        for name, attr in ((QUEUE_TIME, "queue_time_p95"), (TTFT, "ttft_p95")):
            current = sorted(histograms.get(name, {}).items())
            previous = dict(self._last.get(name, []))
            recent = [(bound, count - previous.get(bound, 0.0)) for bound, count in current]
            if recent and recent[-1][1] < 0:   # the server restarted: its counters began again
                recent = current
            value = _quantile(recent, 0.95)
            if value is not None:
                setattr(self, attr, value)
            self._last[name] = current
        self.scraped = True
