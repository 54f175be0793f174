"""When generated tokens leave an engine: one request's stream, coalesced by size and by time.

Every backend streams a request's tokens through a :class:`ChunkBuffer`. A
chunk goes out when

* ``stream_interval`` tokens are pending (a chunk never holds more: a larger
  delta is split),
* the oldest pending token has waited ``flush_interval_s``,
* the weight version changes (a chunk never mixes versions), or
* the request ends (the final chunk carries what is left, usage and segments).

The checks run when tokens arrive (after an engine step or an engine delta),
so a token waits at most ``flush_interval_s`` plus one step. That bound is
also what a crash costs: the balancer resumes from the tokens it received.
Without the time bound a chunk per ``stream_interval`` tokens would be sent
per engine step at low rates and per token at ``stream_interval`` 1; with it,
message rates follow time, not the engine's step rate.
"""

from __future__ import annotations

import asyncio

from .types import FinishReason, GenerationChunk, EngineRequest, TokenSegment, Usage

DEFAULT_FLUSH_INTERVAL_S = 0.2
"""Engines' default ``flush_interval_s``: at 50-200 tokens/s per request a chunk carries 10-40 tokens."""


class ChunkBuffer:
    """The tokens of one request: its segments so far and the part not yet sent (see the module docstring).

    Only the event-loop thread touches it; chunks (or one exception) go to :attr:`queue`.
    """

    __slots__ = ("request_id", "stream_interval", "flush_interval_s", "replica_id", "node_id", "queue",
                 "segments", "count", "pending", "pending_logprobs", "pending_version", "pending_since")

    def __init__(self, request_id: str, *, stream_interval: int, flush_interval_s: float | None,
                 replica_id: str, node_id: str) -> None:
        self.request_id = request_id
        self.stream_interval = stream_interval
        self.flush_interval_s = flush_interval_s
        """None or 0: by size only."""
        self.replica_id = replica_id
        self.node_id = node_id
        self.queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        self.segments: list[TokenSegment] = []
        """This engine's output, one segment per weight version."""
        self.count = 0
        """Tokens this engine generated for the request."""
        self.pending: list[int] = []
        self.pending_logprobs: list[float] = []
        self.pending_version: int | None = None
        self.pending_since = 0.0

    @classmethod
    def for_request(cls, request: EngineRequest, *, stream_interval: int, flush_interval_s: float | None,
                    replica_id: str, node_id: str) -> ChunkBuffer:
        """The buffer of ``request``: its own ``stream_interval`` and ``flush_interval_s`` where it sets them,
        else the engine's (the two keyword arguments)."""
        return cls(request.request_id, stream_interval=request.stream_interval or stream_interval,
                   flush_interval_s=flush_interval_s if request.flush_interval_s is None else request.flush_interval_s,
                   replica_id=replica_id, node_id=node_id)

    def add(self, token_ids: list[int], logprobs: list[float], version: int, now: float) -> None:
        """Record new tokens (``logprobs`` aligned with them, or empty when not requested)."""
        if self.pending and self.pending_version != version:
            self.flush()
        if not self.segments or self.segments[-1].weight_version != version:
            self.segments.append(TokenSegment([], [], version, self.replica_id, self.node_id))
        segment = self.segments[-1]
        segment.token_ids.extend(token_ids)
        if logprobs:
            segment.logprobs.extend(logprobs)
            self.pending_logprobs.extend(logprobs)
        if not self.pending:
            self.pending_since = now
        self.pending.extend(token_ids)
        self.pending_version = version
        self.count += len(token_ids)

    def flush_due(self, now: float) -> None:
        """Send what the size and time bounds say must go now."""
        size = self.stream_interval
        while len(self.pending) >= size:
            self.flush(size)
        interval = self.flush_interval_s
        if self.pending and interval and now - self.pending_since >= interval:
            self.flush()

    def flush(self, count: int | None = None) -> None:
        """Send the first ``count`` pending tokens (all by default) as one chunk."""
        if not self.pending:
            return
        if count is None or count >= len(self.pending):
            tokens, logprobs, self.pending, self.pending_logprobs = self.pending, self.pending_logprobs, [], []
        else:
            tokens, self.pending = self.pending[:count], self.pending[count:]
            logprobs, self.pending_logprobs = self.pending_logprobs[:count], self.pending_logprobs[count:]
        self.queue.put_nowait(GenerationChunk(self.request_id, tokens, logprobs, self.pending_version or 0))

    def finish(self, reason: FinishReason, usage: Usage, resumed: list[TokenSegment], current_version: int) -> None:
        """Send the final chunk: the pending tokens (split by ``stream_interval`` first), usage, and every
        segment, ``resumed`` (copied) first. Its version is its tokens', else ``current_version``."""
        while len(self.pending) > self.stream_interval:
            self.flush(self.stream_interval)
        version = self.pending_version if self.pending and self.pending_version is not None else current_version
        segments = [TokenSegment(list(s.token_ids), list(s.logprobs), s.weight_version, s.replica_id, s.node_id)
                    for s in resumed] + self.segments
        self.queue.put_nowait(GenerationChunk(self.request_id, self.pending, self.pending_logprobs, version,
                                              reason, usage, segments))
        self.pending, self.pending_logprobs = [], []
