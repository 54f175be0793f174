"""Per-request state of step-driven engines, and what a backend sees of it.

:class:`ActiveRequest` is the engine-side record of one in-flight request
(only the event-loop thread touches it). :class:`RowSpec` and
:class:`StepBatch` are the read-only copies handed to a backend for one step.
"""

from __future__ import annotations

import asyncio
import dataclasses

from .chunking import ChunkBuffer
from .types import FinishReason, EngineRequest, SamplingParams


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """What a backend needs to know about one row of a step (a read-only copy)."""

    request_id: str
    sampling: SamplingParams
    seed: int
    """Sampling seed (the request's, or one drawn at submission)."""
    completion_index: int
    """Index, within the whole completion (resumed prefix included), of the token this step produces."""
    context: tuple[int, ...] = ()
    """Prompt + resumed prefix; only filled for rows joining the batch in this step."""
    session_id: str = ""
    """The request's session (its KV may be kept for the session's next request)."""


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Input of one decode-loop iteration."""

    dropped: list[str]
    """Rows that left the batch since the last step; release their state first."""
    running: list[RowSpec]
    """Rows already in the batch: decode one token each."""
    admitted: list[RowSpec]
    """Rows joining now: prefill their context and produce their first token."""
    holds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Of ``dropped``, those that finished asking their session's KV held: request id -> seconds."""


class ActiveRequest:
    """Mutable state of one in-flight request. Only the event-loop thread touches it."""

    def __init__(self, request: EngineRequest, seed: int, now: float, out: ChunkBuffer,
                 enders: frozenset[int]) -> None:
        self.request = request
        self.prefix = request.resumed_token_ids()
        self.seed = seed
        self.submitted_at = now
        self.admitted_at: float | None = None
        self.last_token_at: float | None = None
        self.out = out
        """This engine's tokens of the request and the chunks they leave in (``out.queue``)."""
        self.enders = enders
        """Token ids that end the request with STOP: its stop ids, and the engine's EOS ids unless ignore_eos."""
        self.abort_requested = False
        self.cached_tokens = 0
        """Context tokens whose KV the engine had cached when it admitted the request (not recomputed)."""
        self.preemptions = 0
        """Times the engine preempted it for KV (it then waited to be admitted again)."""
        self.finish_reason: FinishReason | None = None
        self.done = asyncio.Event()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def completion_tokens(self) -> int:
        return len(self.prefix) + self.out.count

    @property
    def reserved_tokens(self) -> int:
        """Worst-case KV footprint: prompt + max_tokens."""
        return len(self.request.prompt_token_ids) + self.request.sampling.max_tokens

    @property
    def hold_kv_s(self) -> float:
        """How long its session's KV is to be held now that it left: the request's ``hold_kv_s`` when it
        finished (STOP or LENGTH) in a session, else 0 (an aborted request is resumed, not continued)."""
        request = self.request
        if request.session_id and self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            return request.hold_kv_s
        return 0.0

    @property
    def held_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + self.completion_tokens

    def row(self, with_context: bool) -> RowSpec:
        context = tuple(self.request.prompt_token_ids) + tuple(self.prefix) if with_context else ()
        return RowSpec(self.request_id, self.request.sampling, self.seed, self.completion_tokens, context,
                       self.request.session_id)
