"""Plain data types shared by every engine backend, and request validation.

Nothing here imports torch: the synthetic engine and the replica agent's
servicers use these types without loading a model stack.
"""

from __future__ import annotations

import dataclasses
import enum

from mesh_runtime.generation import check_request_head, check_resumed, check_sampling_values, check_token_ids
from weight_transfer.spec import WeightSpec  # noqa: F401 - defined once there; engines import it from here

from .errors import InvalidRequest


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
    """Keep only the k most likely tokens; 0 or -1 disables it (below -1 is refused, as on the wire)."""
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
class EngineRequest:
    """What an engine serves: one completion to generate (or to continue, when ``resume_segments`` is set).
    The trainer's side of a generation is :class:`trainer_agent.driver.rollout_types.RolloutRequest`."""

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
    hold_kv_s: float = 0.0
    """With ``session_id``: after the request ends, keep its sequence's KV for the session's next request
    this long (a turn that ends in a tool call), ahead of KV nobody will come back for; engines with a
    prefix cache honour it and give it up under pressure. 0: not held."""
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


def validate_sampling(sp: SamplingParams) -> None:
    """Raise :class:`InvalidRequest` if ``sp`` is not a usable set of sampling parameters (the mesh's one rule
    set: :func:`mesh_runtime.generation.check_sampling_values`)."""
    check_sampling_values(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                          seed=sp.seed, stop_token_ids=sp.stop_token_ids, error=InvalidRequest, prefix="",
                          typed=False)


def validate_request(
    req: EngineRequest,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    max_total_tokens: int | None = None,
) -> None:
    """Raise :class:`InvalidRequest` unless ``req`` can be served.

    The mesh's rules of a generation request (:mod:`mesh_runtime.generation`, the same the balancer and the
    agents apply on the wire), then the engine's own limits: token ids must be below ``vocab_size``; prompt
    plus ``max_tokens`` must fit ``max_model_len`` (the model's context) and ``max_total_tokens`` (the KV
    capacity). A request already ``checked`` where it entered the process is checked against these limits
    only.
    """
    if not req.checked:
        check_request_head(req.request_id, req.prompt_token_ids, error=InvalidRequest, typed=False)
        validate_sampling(req.sampling)
        check_resumed(req.request_id, [(s.token_ids, s.logprobs) for s in req.resume_segments],
                      req.sampling.max_tokens, error=InvalidRequest, typed=False)
    _check_limits(req, vocab_size, max_model_len, max_total_tokens)


def _check_limits(req: EngineRequest, vocab_size: int | None, max_model_len: int | None,
                  max_total_tokens: int | None) -> None:
    """The engine's own limits: the vocabulary (when ``vocab_size`` is given here), the context, the KV
    capacity."""
    if vocab_size is not None:
        check_token_ids(req.prompt_token_ids, "prompt_token_ids", error=InvalidRequest, typed=False,
                        vocab_size=vocab_size)
        for i, seg in enumerate(req.resume_segments):
            check_token_ids(seg.token_ids, f"resume_segments[{i}].token_ids", error=InvalidRequest, typed=False,
                            vocab_size=vocab_size)
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
