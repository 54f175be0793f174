"""Plain data types shared by every engine backend, and request validation.

Nothing here imports torch: the synthetic engine and the replica agent's
servicers use these types without loading a model stack.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from weight_transfer.spec import WeightSpec  # noqa: F401 - defined once there; engines import it from here

from .errors import InvalidRequest

MAX_SEED = 2**64 - 1


class FinishReason(enum.Enum):
    """Why a generation ended."""

    STOP = "stop"
    """A stop token (an EOS id of the model or one of ``stop_token_ids``) was sampled."""
    LENGTH = "length"
    """The request reached ``sampling.max_tokens`` (resumed prefix included)."""
    ABORTED = "aborted"
    """The request was aborted (explicit abort, pause/sleep in abort mode, close)."""


class EngineState(enum.StrEnum):
    """Coarse lifecycle state of an engine, as reported to the control plane."""

    LOADING = "LOADING"
    """Created, ``start()`` not finished yet."""
    ACTIVE = "ACTIVE"
    """Serving generations."""
    PAUSED = "PAUSED"
    """Paused: new generations are refused; in-flight ones may still be draining."""
    SLEEPING = "SLEEPING"
    """Weights and/or KV cache released by ``sleep()``; ``wake_up()`` not complete."""
    AWAITING_WEIGHTS = "AWAITING_WEIGHTS"
    """Awake after a level-2 sleep; generation waits for ``load_weights()``."""
    CLOSED = "CLOSED"
    """``close()`` was called."""
    DEAD = "DEAD"
    """The decode loop failed; the engine must be recreated."""


@dataclasses.dataclass
class SamplingParams:
    """How to sample one completion."""

    max_tokens: int = 16
    """Upper bound on completion tokens, counting tokens of resumed segments."""
    temperature: float = 1.0
    """Softmax temperature; 0 selects greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or negative disables it."""
    seed: int | None = None
    """Seed for this request's sampling. Token ``i`` of the completion draws its
    random number from ``(seed, i)`` only, so a resumed request with the same
    seed continues exactly like the uninterrupted one."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Extra token ids that end generation (the stop token is included in the output)."""
    logprobs: bool = False
    """Return the log-probability of every sampled token."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS token(s); ``stop_token_ids`` still apply."""


@dataclasses.dataclass
class TokenSegment:
    """A run of completion tokens produced under one weight version by one replica."""

    token_ids: list[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """Same length as ``token_ids`` when logprobs were requested, else empty."""
    weight_version: int = 0
    replica_id: str = ""
    node_id: str = ""


@dataclasses.dataclass
class GenerationRequest:
    """One completion to generate (or to continue, when ``resume_segments`` is set)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    resume_segments: list[TokenSegment] = dataclasses.field(default_factory=list)
    """Completion tokens already generated elsewhere (e.g. before an abort);
    generation continues after them and counts them against ``max_tokens``."""
    stream_interval: int | None = None
    """Most tokens per streamed chunk for this request; ``None``: the engine's interval."""
    flush_interval_s: float | None = None
    """Longest a generated token waits before it is streamed (0: by size only); ``None``: the engine's."""
    session_id: str = ""
    """The session (trajectory) the request belongs to; an engine may keep its context until
    ``close_session``. Empty: none."""
    checked: bool = False
    """True when the request passed the mesh's checks where it entered this process (the replica agent's
    decoding of a Generate call, :func:`replica_agent.convert.generation_request`): the engine then checks
    only what is its own (token ids against its vocabulary, lengths against its context and KV capacity),
    so a request is validated once per process."""

    def resumed_token_ids(self) -> list[int]:
        """The resumed completion prefix, in order."""
        return [t for seg in self.resume_segments for t in seg.token_ids]


@dataclasses.dataclass
class Usage:
    """Token accounting of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    """All completion tokens, resumed ones included."""
    resumed_tokens: int
    cached_tokens: int = 0
    """Context tokens (prompt and resumed prefix) the engine found in its prefix cache instead of computing."""


@dataclasses.dataclass
class GenerationChunk:
    """A piece of a generation stream. All tokens of one chunk were produced
    under the same weight version."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: FinishReason | None = None
    """Set on the final chunk only."""
    usage: Usage | None = None
    """Set on the final chunk only."""
    segments: list[TokenSegment] = dataclasses.field(default_factory=list)
    """Final chunk only: the resumed segments followed by this engine's segments
    (one per weight version it generated under)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class LoadSnapshot:
    """Point-in-time load of one engine, for load reports and routing."""

    running: int
    waiting: int
    kv_cache_usage: float
    """``used_tokens / max_total_tokens``, in 0..1."""
    max_total_tokens: int
    used_tokens: int
    tokens_per_second: float
    """Completion tokens emitted per second over the metrics rate window."""
    queue_time_p95_s: float
    """95th percentile of submit-to-admission delay."""
    ttft_p95_s: float
    """95th percentile of submit-to-first-token delay."""
    itl_mean_s: float
    """Mean inter-token latency within a request."""
    itl_p95_s: float
    prefix_cache_tokens: int = 0
    """Tokens whose KV the prefix cache holds (0: no prefix cache)."""
    prefix_cache_hit_rate: float = 0.0
    """Cached over prompt tokens of recent admissions, 0..1."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(ids: object, what: str, vocab_size: int | None) -> None:
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequest(f"{what} must be a list of token ids")
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size):
        return   # the usual case, checked at C speed; otherwise find the first bad one below
    for t in ids:
        if not _is_int(t) or t < 0:
            raise InvalidRequest(f"{what} holds {t!r}; token ids are non-negative integers")
        if vocab_size is not None and t >= vocab_size:
            raise InvalidRequest(f"{what} holds token id {t}, outside the vocabulary of {vocab_size}")


def validate_sampling(sp: SamplingParams) -> None:
    """Raise :class:`InvalidRequest` if ``sp`` is not a usable set of sampling parameters."""
    if not _is_int(sp.max_tokens) or sp.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be an integer >= 1, got {sp.max_tokens!r}")
    temp = sp.temperature
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temp!r}")
    top_p = sp.top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(sp.top_k):
        raise InvalidRequest(f"top_k must be an integer (<= 0 disables it), got {sp.top_k!r}")
    if sp.seed is not None and (not _is_int(sp.seed) or not 0 <= sp.seed <= MAX_SEED):
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {sp.seed!r}")
    _check_token_ids(sp.stop_token_ids, "stop_token_ids", None)


def validate_request(
    req: GenerationRequest,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    max_total_tokens: int | None = None,
) -> None:
    """Raise :class:`InvalidRequest` unless ``req`` can be served.

    The keyword limits are the engine's: token ids must be below
    ``vocab_size``; prompt plus ``max_tokens`` must fit ``max_model_len``
    (the model's context) and ``max_total_tokens`` (the KV capacity). A request already ``checked`` where it
    entered the process is checked against these limits only.
    """
    if req.checked:
        _check_limits(req, vocab_size, max_model_len, max_total_tokens)
        return
    if not isinstance(req.request_id, str) or not req.request_id:
        raise InvalidRequest("request_id must be a non-empty string")
    if not req.prompt_token_ids:
        raise InvalidRequest(f"request {req.request_id}: the prompt is empty")
    _check_token_ids(req.prompt_token_ids, "prompt_token_ids", vocab_size)
    sp = req.sampling
    validate_sampling(sp)
    for i, seg in enumerate(req.resume_segments):
        _check_token_ids(seg.token_ids, f"resume_segments[{i}].token_ids", vocab_size)
        if seg.logprobs and len(seg.logprobs) != len(seg.token_ids):
            raise InvalidRequest(
                f"resume_segments[{i}] has {len(seg.logprobs)} logprobs for {len(seg.token_ids)} tokens"
            )
    resumed = sum(len(seg.token_ids) for seg in req.resume_segments)
    if resumed >= sp.max_tokens:
        raise InvalidRequest(
            f"request {req.request_id}: the resumed prefix already holds {resumed} tokens, "
            f"which meets max_tokens={sp.max_tokens}; nothing is left to generate"
        )
    _check_limits(req, None, max_model_len, max_total_tokens)


def _check_limits(req: GenerationRequest, vocab_size: int | None, max_model_len: int | None,
                  max_total_tokens: int | None) -> None:
    """The engine's own limits: the vocabulary (when ``vocab_size`` is given here), the context, the KV
    capacity."""
    if vocab_size is not None:
        _check_token_ids(req.prompt_token_ids, "prompt_token_ids", vocab_size)
        for i, seg in enumerate(req.resume_segments):
            _check_token_ids(seg.token_ids, f"resume_segments[{i}].token_ids", vocab_size)
    sp = req.sampling
    total = len(req.prompt_token_ids) + sp.max_tokens
    if max_model_len is not None and total > max_model_len:
        raise InvalidRequest(
            f"request {req.request_id}: prompt ({len(req.prompt_token_ids)}) + max_tokens "
            f"({sp.max_tokens}) = {total} exceeds the model context of {max_model_len}"
        )
    if max_total_tokens is not None and total > max_total_tokens:
        raise InvalidRequest(
            f"request {req.request_id}: prompt + max_tokens = {total} exceeds the engine's "
            f"KV capacity of {max_total_tokens} tokens"
        )
