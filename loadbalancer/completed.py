"""The balancer's record of completed requests, bounded by count, bytes and age.

A repeated ``request_id`` is answered from its record instead of being
generated twice (exactly-once per id). The record holds the generated tokens,
so its size grows with the response: the cache is bounded three ways, each a
config key of the balancer:

* ``completed_cache_size`` - entries;
* ``completed_cache_bytes`` - the records' serialized size in total; a record
  larger than the whole bound is not kept (its repeat is generated again and
  counted as ``too_large``);
* ``completed_cache_ttl_s`` - age; older records are dropped on the next
  access.

The oldest records go first. :attr:`CompletedCache.entries` and
:attr:`CompletedCache.bytes` are the gauges of its size.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from rollmesh.loadbalancer.v1 import loadbalancer_pb2


class CompletedCache:
    """``request_id -> GenerateResponse`` of completed requests; see the module docstring."""

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._clock = clock
        self._records: OrderedDict[str, tuple[loadbalancer_pb2.GenerateResponse, int, float]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.expired = 0
        self.too_large = 0

    @property
    def entries(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return self.get(request_id) is not None

    def get(self, request_id: str) -> loadbalancer_pb2.GenerateResponse | None:
        self._expire()
        found = self._records.get(request_id)
        return None if found is None else found[0]

    def put(self, request_id: str, record: loadbalancer_pb2.GenerateResponse) -> None:
        size = record.ByteSize()
        self._drop(request_id)
        if size > self.max_bytes:
            self.too_large += 1
            return
        self._records[request_id] = (record, size, self._clock())
        self.bytes += size
        self._expire()
        while self._records and (len(self._records) > self.max_entries or self.bytes > self.max_bytes):
            oldest = next(iter(self._records))
            self._drop(oldest)
            self.evicted += 1

    def _drop(self, request_id: str) -> None:
        found = self._records.pop(request_id, None)
        if found is not None:
            self.bytes -= found[1]

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl_s
        while self._records:
            oldest, (_, _, stored_at) = next(iter(self._records.items()))
            if stored_at >= horizon:
                return
            self._drop(oldest)
            self.expired += 1
