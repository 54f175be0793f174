"""The replicas' own prefix-cache events in the balancer's prefix index (``prefix_routing.kv_events``).

Without events the index predicts: it records a prompt's blocks where it routes the prompt and ages them out
least recently used at ``cache_tokens``. With events each agent in the table streams ``WatchPrefixCache``:
a replica's blocks as its engine stores and evicts them, and a reset when new weights empty its cache, so
the index forgets exactly what the engine forgot (routing still records blocks at once, for siblings sent
before their prompt is prefilled). One stream per agent address, opened when a route at that address
appears, reopened with backoff when it breaks, closed when the address leaves the table. Each replica is
indexed at the block size its events give (its engine's), whatever ``block_tokens`` says: the predicted
entries of another size are dropped when its first event arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from mesh_runtime.retry import RetryPolicy
from rollmesh.replica.v1 import replica_agent_pb2

from .table import RoutingTable

log = logging.getLogger(__name__)


class _Delivered(grpc.aio.AioRpcError):
    """A stream that broke after delivering events (its backoff starts over)."""

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        super().__init__(err.code(), err.initial_metadata(), err.trailing_metadata(), err.details(),
                         err.debug_error_string())


class PrefixWatchers:
    """One ``WatchPrefixCache`` stream per agent address of ``table``; see the module docstring."""

    def __init__(self, table: RoutingTable, stub_for: Callable[[str], Any], *, retry_s: float = 1.0,
                 max_retry_s: float = 30.0) -> None:
        if table.prefix is None:
            raise ValueError("prefix events need a prefix-aware routing table")
        self.table = table
        self.index = table.prefix.index
        self._stub_for = stub_for
        self._retry_s, self._max_retry_s = retry_s, max_retry_s
        self._tasks: dict[str, tuple[asyncio.Task, frozenset[str]]] = {}
        self._sizeless: set[str] = set()
        self.applied = 0
        """Event messages applied to the index (for tests and logs)."""
        table.on_change(self.sync)

    def sync(self) -> None:
        """Start a stream for each new address (or one that gained replicas), stop those that left."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return   # routes from the config, before the server runs: start() syncs
        by_address: dict[str, set[str]] = {}
        for route in self.table.routes.values():
            by_address.setdefault(route.address, set()).add(route.replica_id)
        for address, (task, _) in list(self._tasks.items()):
            if address not in by_address:
                task.cancel()
                del self._tasks[address]
        for address, ids in by_address.items():
            running = self._tasks.get(address)
            if running is not None and (not running[0].done() or running[1] >= ids):
                continue
            if running is not None:
                running[0].cancel()
            task = asyncio.get_running_loop().create_task(self._watch(address), name=f"prefix-events {address}")
            self._tasks[address] = (task, frozenset(ids))

    async def start(self) -> None:
        self.sync()

    async def close(self) -> None:
        tasks = [task for task, _ in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, address: str) -> None:
        """Follow one agent's events until it says it has none; a broken stream is opened again after a
        growing pause (from ``retry_s`` up to ``max_retry_s``), which starts over once it delivered anything."""
        policy = RetryPolicy(initial_s=self._retry_s, max_s=max(self._max_retry_s, self._retry_s))

        def broke(err: BaseException, wait: float) -> None:
            code = err.code().name if isinstance(err, grpc.aio.AioRpcError) else type(err).__name__
            log.debug("prefix events of %s broke (%s); again in %.1f s", address, code, wait)

        def again(err: BaseException) -> bool:
            return isinstance(err, grpc.aio.AioRpcError) and err.code() != grpc.StatusCode.UNIMPLEMENTED

        try:
            await policy.run(lambda: self._follow(address), retry_if=again, on_retry=broke,
                             progressed=lambda err: isinstance(err, _Delivered))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("agent %s serves no WatchPrefixCache: its replicas' prefixes stay predicted", address)

    async def _follow(self, address: str) -> None:
        """Apply one stream's events until it ends (its agent publishes none); a break after some events is
        raised as :class:`_Delivered`."""
        delivered = False
        try:
            async for message in self._stub_for(address).WatchPrefixCache(replica_agent_pb2.WatchPrefixCacheRequest()):
                delivered = True
                self._apply(address, message)
        except grpc.aio.AioRpcError as err:
            if delivered and err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _Delivered(err) from err
            raise

    def _apply(self, address: str, message: replica_agent_pb2.WatchPrefixCacheResponse) -> None:
        route = self.table.routes.get(message.replica_id)
        if route is None or route.address != address:
            return   # a replica of that agent this balancer does not route to
        if message.block_tokens < 1:
            if message.replica_id not in self._sizeless:
                self._sizeless.add(message.replica_id)
                log.warning("replica %s publishes prefix events with no block size: its events are ignored",
                            message.replica_id, extra={"replica_id": message.replica_id})
            return
        if message.block_tokens != self.index.block_size(message.replica_id):
            log.info("replica %s: prefix events of %d-token blocks; its prefixes are indexed at that size",
                     message.replica_id, message.block_tokens, extra={"replica_id": message.replica_id})
        self.index.apply(message.replica_id, block_tokens=message.block_tokens, reset=message.reset,
                         stored=message.stored, removed=message.removed)
        self.applied += 1
