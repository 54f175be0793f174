"""Translation of one request's engine outputs into rollmesh generation chunks.

Out-of-process engines (vLLM, SGLang) hand over each request's completion as
a series of deltas: new token ids, their log-probabilities, and a finish
reason on the last one. :meth:`RequestStream.accept_delta` takes them in that
engine-neutral form; :meth:`RequestStream.accept` reads vLLM's outputs.

The vLLM backend asks for ``RequestOutputKind.DELTA`` outputs, so every
``RequestOutput`` it receives carries only the tokens produced since the
previous one (``outputs[0].token_ids``), their log-probabilities
(``outputs[0].logprobs``: one ``{token_id: Logprob}`` dict per token) and, on
the last one, ``finished=True`` with ``outputs[0].finish_reason`` set to
``"stop"``, ``"length"`` or ``"abort"`` (see ``vllm/outputs.py`` and
``vllm/sampling_params.py``). :class:`RequestStream` regroups those tokens
into chunks (by size and time, :mod:`.chunking`), tags them with the weight version in
force when they arrived, enforces the completion budget and records the
latency figures behind ``load_snapshot``. It never talks to vLLM itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from .chunking import DEFAULT_FLUSH_INTERVAL_S, ChunkBuffer
from .metrics import EngineMetrics
from .types import FinishReason, EngineRequest, Usage

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORTED,
}


def map_finish_reason(reason: object) -> FinishReason:
    """vLLM's finish reason string -> :class:`FinishReason`.

    Anything else (``None`` on a finished output, or reasons such as
    ``"error"`` that newer vLLM releases report) ends the stream as ABORTED:
    the partial completion is still valid and the caller may resume it.
    """
    mapped = _FINISH_REASONS.get(str(reason) if reason is not None else "")
    if mapped is None:
        log.warning("vllm reported finish reason %r; ending the stream as aborted", reason)
        return FinishReason.ABORTED
    return mapped


def sampled_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """Log-probability of each sampled token of a delta output.

    With ``logprobs=0`` vLLM returns, per new token, a dict holding just the
    sampled token's ``Logprob`` (``.logprob``). A missing entry becomes NaN
    rather than shifting the alignment of the rest.
    """
    entries = list(completion.logprobs or [])
    values: list[float] = []
    for i, token in enumerate(token_ids):
        entry = entries[i] if i < len(entries) else None
        logprob = entry.get(token) if isinstance(entry, Mapping) else None
        values.append(float(logprob.logprob) if logprob is not None else math.nan)
    return values


def engine_queue_time(output: Any) -> float | None:
    """Queue time measured by vLLM's engine core, when the output carries it.

    ``RequestOutput.metrics`` is a ``RequestStateStats`` with ``queued_ts``
    and ``scheduled_ts`` (engine-core monotonic clock) when vLLM logs stats
    (``vllm/v1/metrics/stats.py``); it is not part of the documented API, so
    its absence is expected and handled.
    """
    stats = getattr(output, "metrics", None)
    queued = getattr(stats, "queued_ts", None)
    scheduled = getattr(stats, "scheduled_ts", None)
    if isinstance(queued, (int, float)) and isinstance(scheduled, (int, float)) and 0 < queued <= scheduled:
        return float(scheduled - queued)
    return None


class RequestStream:
    """State of one in-flight request of the vLLM backend.

    Only the event-loop thread touches it. The owner feeds vLLM outputs to
    :meth:`accept` and reads chunks (or one exception) from :attr:`queue`.
    """

    def __init__(
        self,
        request: EngineRequest,
        *,
        stream_interval: int,
        flush_interval_s: float | None = DEFAULT_FLUSH_INTERVAL_S,
        replica_id: str,
        node_id: str,
        clock: Callable[[], float],
        metrics: EngineMetrics,
    ) -> None:
        self.request = request
        self.prefix = request.resumed_token_ids()
        self.budget = request.sampling.max_tokens - len(self.prefix)
        """Tokens this engine may still add (``max_tokens`` minus the resumed prefix)."""
        self.out = ChunkBuffer.for_request(request, stream_interval=stream_interval,   # the engine's defaults
                                           flush_interval_s=flush_interval_s, replica_id=replica_id, node_id=node_id)
        self.queue = self.out.queue
        """The chunks (or one exception) of this request."""
        self._clock = clock
        self._metrics = metrics
        self.submitted_at = clock()
        self.first_output_at: float | None = None
        self.last_token_at: float | None = None
        self.done = asyncio.Event()
        self.abort_requested = False
        self.task: asyncio.Task[None] | None = None
        """The task that consumes vLLM's output stream for this request."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context(self) -> list[int]:
        """What vLLM is asked to continue: the prompt followed by the resumed prefix."""
        return list(self.request.prompt_token_ids) + self.prefix

    @property
    def held_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.prefix) + self.out.count

    @property
    def admitted(self) -> bool:
        """Whether vLLM has produced anything for it yet (i.e. scheduled it)."""
        return self.first_output_at is not None

    # ---------------------------------------------------------------- outputs
    def accept(self, output: Any, version: int) -> bool:
        """Consume one delta ``RequestOutput``; return True once the stream is
        final. Tokens beyond the budget are dropped and end it with LENGTH."""
        if self.done.is_set():
            return True
        completion = output.outputs[0] if getattr(output, "outputs", None) else None
        token_ids = [int(t) for t in completion.token_ids] if completion is not None else []
        logprobs = (sampled_logprobs(completion, token_ids)
                    if completion is not None and self.request.sampling.logprobs else [])
        finish = None
        if output.finished:
            finish = map_finish_reason(getattr(completion, "finish_reason", None) if completion is not None else None)
        return self.accept_delta(token_ids, logprobs, finish, version, queue_time=engine_queue_time(output))

    def accept_delta(self, token_ids: list[int], logprobs: list[float], finish: FinishReason | None,
                     version: int, *, queue_time: float | None = None) -> bool:
        """Consume one delta: ``token_ids`` new since the last one (``logprobs`` aligned with them when
        requested, else empty) and ``finish`` on the last one; return True once the stream is final. Tokens
        beyond the budget are dropped and end it with LENGTH. ``queue_time`` is the engine's own
        measurement of the first delta's queueing, where it has one."""
        if self.done.is_set():
            return True
        now = self._clock()
        if self.first_output_at is None:
            self.first_output_at = now
            self._metrics.record_queue_time(queue_time if queue_time is not None else now - self.submitted_at)
        room = self.budget - self.out.count
        if len(token_ids) > room:
            log.warning("request %s: the engine returned tokens beyond max_tokens; truncating", self.request_id)
            token_ids, logprobs = token_ids[:room], logprobs[:room]
        if token_ids:
            self._append(token_ids, logprobs, version, now)
        if finish is not None:
            self.finish(finish, version)
        elif self.out.count >= self.budget:
            self.finish(FinishReason.LENGTH, version)
        return self.done.is_set()

    def _append(self, token_ids: list[int], logprobs: list[float], version: int, now: float) -> None:
        self.out.add(token_ids, logprobs, version, now)
        if self.last_token_at is None:
            self._metrics.record_ttft(now - self.submitted_at)
        else:
            self._metrics.record_itl((now - self.last_token_at) / len(token_ids))
        self.last_token_at = now
        self._metrics.record_tokens(len(token_ids))
        self.out.flush_due(now)

    # ------------------------------------------------------------------- ends
    def finish(self, reason: FinishReason, current_version: int) -> None:
        """Send the final chunk (remaining tokens, usage, segments). Idempotent.

        The final chunk's version is that of its tokens, or ``current_version``
        (the engine's) when it carries none."""
        if self.done.is_set():
            return
        usage = Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=len(self.prefix) + self.out.count,
            resumed_tokens=len(self.prefix),
        )
        self.out.finish(reason, usage, self.request.resume_segments, current_version)
        self.done.set()

    def fail(self, error: BaseException) -> None:
        """End the stream by raising ``error`` in its consumer. Idempotent."""
        if self.done.is_set():
            return
        self.queue.put_nowait(error)
        self.done.set()
