"""The completed-request cache is bounded by count, bytes and age (convergence issue, defect 8)."""

from __future__ import annotations

import pytest

from loadbalancer.completed import CompletedCache
from loadbalancer.config import LoadBalancerConfig
from loadbalancer.stats import Stats
from mesh_runtime.config import ConfigError
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(tokens: int) -> loadbalancer_pb2.GenerateResponse:
    return loadbalancer_pb2.GenerateResponse(request_id="r", token_ids=list(range(1000, 1000 + tokens)))


def test_100k_token_results_stay_within_the_byte_bound():
    # the measurement: 75 results of 100k tokens grew the balancer from 50 to 216 MB
    cache = CompletedCache(max_entries=10_000, max_bytes=1_000_000, ttl_s=600)
    big = record(100_000)
    size = big.ByteSize()
    assert size > 200_000
    for i in range(75):
        cache.put(f"req-{i}", big)
        assert cache.bytes <= 1_000_000
    assert cache.entries == 1_000_000 // size and cache.bytes == cache.entries * size
    assert cache.get("req-74") is not None and cache.get("req-0") is None      # the oldest went first
    assert cache.evicted == 75 - cache.entries


def test_count_bound_age_bound_and_too_large_records():
    clock = Clock()
    cache = CompletedCache(max_entries=3, max_bytes=10_000, ttl_s=60, clock=clock)
    for i in range(5):
        cache.put(f"r{i}", record(10))
    assert [f"r{i}" in cache for i in range(5)] == [False, False, True, True, True]
    clock.now = 61
    assert cache.get("r4") is None and cache.entries == 0 and cache.bytes == 0 and cache.expired == 3
    cache.put("huge", record(10_000))                       # larger than the whole bound: not kept
    assert "huge" not in cache and cache.too_large == 1
    cache.put("a", record(5))
    cache.put("a", record(50))                              # replacing a record replaces its size
    assert cache.bytes == record(50).ByteSize()


def test_gauges_and_config_bounds():
    cache = CompletedCache(max_entries=10, max_bytes=10_000, ttl_s=60)
    cache.put("x", record(20))
    families = {m.name: m for m in Stats().families(0, cache)}
    assert families["rollmesh_lb_completed_cache_entries"].samples[0].value == 1
    assert families["rollmesh_lb_completed_cache_bytes"].samples[0].value == cache.bytes > 0
    config = LoadBalancerConfig()
    assert config.completed_cache_bytes == 64 * 1024 * 1024 and config.completed_cache_ttl_s == 600.0
    for key in ("completed_cache_bytes", "completed_cache_ttl_s"):
        bad = LoadBalancerConfig(**{key: 0})
        with pytest.raises(ConfigError, match=key):
            bad.validate()
