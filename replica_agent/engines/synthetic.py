"""``SyntheticEngine``: a model-free engine for benchmarks and the simulator.

It emits deterministic pseudo-random token ids (from the request seed, or
the engine seed and the request id) at a configured pace and ends each
response at a length drawn from a configured distribution, unless
``max_tokens`` comes first. It shares the request lifecycle of the real
engines (:class:`~.core.SteppedEngine`): batching, streaming, abort, pause,
sleep/wake and versioned weight loads behave exactly as the interface says.

Pace model: a token of every running request takes
``max(1 / tokens_per_second, batch_size / aggregate_tokens_per_second)``,
and joining requests add their prefill time. Each request therefore sees
``min(rate, cap / batch_size)`` tokens/s: throughput grows with concurrency
until the aggregate cap. ``inf`` rates take no time at all. One step stands
for ``tokens_per_step`` such decode iterations (the longest run any row still
needs), so the engine's own CPU cost is per chunk of tokens, not per token:
token ids come from 64-token blocks drawn at once per ``(seed, block)``,
still a pure function of the seed and the token's index, so a resumed
request continues exactly where it stopped.

With ``engine_model`` set, the pace comes from :mod:`.engine_model` instead: prefill that costs its uncached
prompt tokens, a block prefix cache shared by requests and kept after them, decode steps that cost more with
the batch and its context, and admission bounded by KV capacity. Results then report ``cached_tokens`` and
load reports the cache's size and hit rate.

Time is injectable (``clock`` and ``sleep``; see :class:`VirtualClock`).
Never the default backend. Does not import torch unless weights are read.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import hashlib
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from .chunking import DEFAULT_FLUSH_INTERVAL_S
from .core import SteppedEngine
from .engine_model import EngineModel, EngineModelConfig, PrefixEvents
from .errors import EngineUnavailable, InvalidRequest, WeightMismatch
from .randomness import mix_seed
from .request_state import ActiveRequest, RowSpec, StepBatch
from .types import EngineRequest, LoadSnapshot, WeightSpec

_LENGTH_STREAM = 0x4C454E  # distinct draw index for the response length
_LOGPROB_SALT = 0x10C9
_BLOCK = 64   # token draws made at once


class VirtualClock:
    """A fake clock for tests: ``sleep`` advances time instantly.

    Pass the instance as ``clock`` and its ``sleep`` as ``sleep``. Suited to
    one engine per clock (each sleeping coroutine moves time forward).
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
        await asyncio.sleep(0)


@dataclasses.dataclass
class LengthDistribution:
    """Distribution of natural response lengths (before ``max_tokens`` applies)."""

    kind: str = "fixed"
    """``"fixed"``, ``"uniform"`` or ``"lognormal"``."""
    value: int = 128
    """Length for ``fixed``."""
    min: int = 1
    """Inclusive lower bound for ``uniform``."""
    max: int = 256
    """Inclusive upper bound for ``uniform``."""
    mu: float = 5.0
    """Mean of the underlying normal for ``lognormal``."""
    sigma: float = 1.0
    """Standard deviation of the underlying normal for ``lognormal``."""
    cap: int = 4096
    """Upper bound applied to ``lognormal`` draws."""

    def validate(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise InvalidRequest(f"length distribution kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if self.kind == "fixed" and self.value < 1:
            raise InvalidRequest(f"fixed response length must be >= 1, got {self.value}")
        if self.kind == "uniform" and not 1 <= self.min <= self.max:
            raise InvalidRequest(f"uniform lengths need 1 <= min <= max, got [{self.min}, {self.max}]")
        if self.kind == "lognormal" and (self.sigma < 0 or self.cap < 1):
            raise InvalidRequest(f"lognormal lengths need sigma >= 0 and cap >= 1, got {self.sigma}, {self.cap}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.min, self.max)
        return max(1, min(self.cap, round(rng.lognormvariate(self.mu, self.sigma))))


def _default_weight_spec() -> list[WeightSpec]:
    return [WeightSpec("embed.weight", "float32", (64, 16)), WeightSpec("head.weight", "float32", (16, 64))]


@dataclasses.dataclass
class SyntheticEngineConfig:
    """Options of :class:`SyntheticEngine` (``create_engine("synthetic", ...)``)."""

    tokens_per_second: float = math.inf
    """Per-request decode rate; ``inf`` means instant."""
    aggregate_tokens_per_second: float = math.inf
    """Cap on the whole batch's decode rate; ``inf`` means no cap."""
    prefill_tokens_per_second: float = math.inf
    """Prompt tokens processed per second when a request joins; ``inf`` means free."""
    lengths: LengthDistribution = dataclasses.field(default_factory=LengthDistribution)
    """Natural response lengths (a ``LengthDistribution`` or a dict of its fields)."""
    seed: int = 0
    """Seeds token ids and lengths of requests that carry no seed of their own."""
    vocab_size: int = 32000
    """Token ids are drawn from ``[0, vocab_size)``, never the EOS id except to stop."""
    eos_token_id: int = 1
    """Emitted as the last token of a response that ends naturally (FinishReason.STOP)."""
    max_model_len: int | None = None
    """Reject requests whose prompt + max_tokens exceed this; ``None``: no limit."""
    replica_id: str = ""
    """Recorded in token segments."""
    node_id: str = ""
    """Recorded in token segments."""
    stream_interval: int = 16
    """Most new tokens per streamed chunk (see :mod:`.chunking`)."""
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    """Longest a generated token waits before it is streamed; 0: by ``stream_interval`` only."""
    tokens_per_step: int = 16
    """Tokens each running request gets per step: one step stands for that many decode iterations, so the
    engine's own cost is per chunk, not per token (its pace is the same). 1 steps token by token as a real
    engine does (abort and pause then act within one token)."""
    max_batch_size: int = 256
    """Most requests decoded together."""
    max_total_tokens: int = 1 << 20
    """Token capacity used for admission and ``kv_cache_usage``."""
    weight_spec: list[WeightSpec] = dataclasses.field(default_factory=_default_weight_spec)
    """Declared weights that ``load_weights`` checks against (from a config: (name, dtype name, shape)
    triples)."""
    weight_version: int = 0
    """Version reported for the initial weights."""
    engine_model: EngineModelConfig | None = None
    """Pace, prefix cache and KV capacity of a modelled GPU engine (an ``EngineModelConfig`` or a dict of its
    fields; ``{}`` for its defaults, Llama-3.1-8B on an H100); replaces the three rates and
    ``max_total_tokens``. ``None``: the rates above."""

    def __post_init__(self) -> None:
        given: Any = self.lengths   # a config passes a mapping
        if isinstance(given, dict):
            self.lengths = LengthDistribution(**given)
        model: Any = self.engine_model
        if isinstance(model, dict):
            unknown = sorted(set(model) - {f.name for f in dataclasses.fields(EngineModelConfig)})
            if unknown:
                raise InvalidRequest(f"synthetic engine: unknown engine_model option(s) {unknown}")
            self.engine_model = EngineModelConfig(**model)
        self.weight_spec = [WeightSpec(n, d, tuple(s)) for n, d, s in self.weight_spec]

    def validate(self) -> None:
        self.lengths.validate()
        for name in ("tokens_per_second", "aggregate_tokens_per_second", "prefill_tokens_per_second"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"synthetic engine: {name} must be > 0 (inf for instant)")
        if self.engine_model is not None:
            self.engine_model.validate()
            paced = [n for n in ("tokens_per_second", "aggregate_tokens_per_second", "prefill_tokens_per_second")
                     if getattr(self, n) != math.inf]
            if paced:
                raise InvalidRequest(f"synthetic engine: {', '.join(paced)} and engine_model both set; the engine "
                                     "model times prefill and decode itself")
        if self.tokens_per_step < 1:
            raise InvalidRequest(f"synthetic engine: tokens_per_step must be >= 1, got {self.tokens_per_step}")
        if not 0 <= self.eos_token_id < self.vocab_size or self.vocab_size < 2:
            raise InvalidRequest("synthetic engine: need vocab_size >= 2 and 0 <= eos_token_id < vocab_size")


_LAZY = object()  # initial weights, materialised from the seed on first read


class SyntheticEngine(SteppedEngine):
    """Model-free engine with configurable pace and response lengths."""

    multi_token_steps = True

    def __init__(
        self,
        config: SyntheticEngineConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        config = config or SyntheticEngineConfig()
        config.validate()
        super().__init__(
            replica_id=config.replica_id,
            node_id=config.node_id,
            stream_interval=config.stream_interval,
            flush_interval_s=config.flush_interval_s,
            max_batch_size=config.max_batch_size,
            max_total_tokens=(config.engine_model.kv_capacity_tokens if config.engine_model is not None
                              else config.max_total_tokens),
            clock=clock or time.monotonic,
        )
        self.config = config
        self.model = (EngineModel(config.engine_model, iterations_per_step=config.tokens_per_step,
                                  clock=clock or time.monotonic)
                      if config.engine_model is not None else None)
        self._sequences: dict[str, list[int]] = {}
        """With the engine model: each running request's context and tokens so far (cached when it ends)."""
        self._preempted: dict[str, list[int]] = {}
        """With the engine model: a preempted request's context and tokens so far, to be admitted with."""
        self._sleep = sleep or asyncio.sleep
        self._weight_version = config.weight_version
        self._targets: dict[str, int] = {}
        self._blocks: dict[str, tuple[int, list[int], list[float]]] = {}
        """Per request, the block of draws in use: (block index, token ids, logprobs)."""
        self._store: Any = _LAZY
        self._host: Any = None

    def _default_seed(self, request: EngineRequest) -> int:
        digest = hashlib.blake2b(request.request_id.encode(), digest_size=8).digest()
        return mix_seed(self.config.seed, int.from_bytes(digest, "little"))

    def target_length(self, seed: int) -> int:
        """Natural response length of a request with sampling seed ``seed``."""
        return self.config.lengths.sample(random.Random(mix_seed(seed, _LENGTH_STREAM)))

    # ------------------------------------------------------------ step hooks
    async def _load_model(self) -> None:
        return None

    async def _unload_model(self) -> None:
        self._store = self._host = None

    def _request_limits(self) -> dict[str, int | None]:
        return {"vocab_size": self.config.vocab_size, "max_model_len": self.config.max_model_len}

    def _eos_token_ids(self) -> frozenset[int]:
        return frozenset([self.config.eos_token_id])

    async def _reset_batch(self) -> None:
        self._targets.clear()
        self._blocks.clear()

    def _reserve(self, active: ActiveRequest) -> bool:
        if self.model is None:
            return super()._reserve(active)
        context = self._preempted.get(active.request_id) or [*active.request.prompt_token_ids, *active.prefix]
        cached = self.model.admit(active.request_id, context,
                                  active.request.sampling.max_tokens - active.completion_tokens,
                                  session=active.request.session_id)
        if cached is None:
            return False
        if not active.preemptions:      # as vLLM: the cache a request found when first scheduled
            active.cached_tokens = cached
        self._preempted.pop(active.request_id, None)
        self._sequences[active.request_id] = context
        return True

    def _grow(self, running: list[ActiveRequest]) -> list[ActiveRequest]:
        if self.model is None:
            return []
        runs = [(active.request_id, self._run_length(active.row(with_context=False))) for active in running]
        preempted = set(self.model.grow(runs, lambda request_id: self._sequences[request_id]))
        for request_id in preempted:
            self._preempted[request_id] = self._sequences.pop(request_id)
        return [active for active in running if active.request_id in preempted]

    def _discard(self, active: ActiveRequest) -> None:
        self._preempted.pop(active.request_id, None)

    def _unreserve(self, active: ActiveRequest) -> None:
        if self.model is None:
            return super()._unreserve(active)
        self.model.release(active.request_id, self._sequences.pop(active.request_id, ()),
                           session=active.request.session_id, hold_s=active.hold_kv_s)

    def _run_length(self, row: RowSpec) -> int:
        """Tokens the row gets this step: ``tokens_per_step``, fewer where its response ends sooner."""
        left = row.sampling.max_tokens - row.completion_index
        if not row.sampling.ignore_eos:
            left = min(left, self._targets[row.request_id] - row.completion_index)
        return max(1, min(self.config.tokens_per_step, left))

    def _step_duration(self, batch: StepBatch, tokens: int) -> float:
        rows = len(batch.running) + len(batch.admitted)
        per_token = max(1.0 / self.config.tokens_per_second, rows / self.config.aggregate_tokens_per_second)
        prompt = sum(len(r.context) for r in batch.admitted)
        return tokens * per_token + prompt / self.config.prefill_tokens_per_second

    async def _execute_step(self, batch: StepBatch) -> list[tuple[list[int], list[float]]]:
        for rid in batch.dropped:
            self._targets.pop(rid, None)
            self._blocks.pop(rid, None)
        for row in batch.admitted:
            self._targets[row.request_id] = self.target_length(row.seed)
        rows = (*batch.running, *batch.admitted)
        runs = [self._run_length(row) for row in rows]
        if self.model is not None:
            await self._sleep(self.model.step_seconds([(row.request_id, run) for row, run in zip(rows, runs)]))
        else:
            await self._sleep(self._step_duration(batch, max(runs, default=1)))
        out = [self._tokens(row, run) for row, run in zip(rows, runs)]
        if self.model is not None:
            for row, (ids, _) in zip(rows, out):
                sequence = self._sequences.get(row.request_id)
                if sequence is not None:
                    sequence += ids
        return out

    async def close_session(self, session_id: str) -> bool:
        return self.model.close_session(session_id) if self.model is not None else False

    def prefix_events(self) -> PrefixEvents | None:
        return self.model.events if self.model is not None else None

    def load_snapshot(self) -> LoadSnapshot:
        snapshot = super().load_snapshot()
        if self.model is None:
            return snapshot
        capacity = self.model.config.kv_capacity_tokens
        return dataclasses.replace(snapshot, used_tokens=self.model.used_tokens,
                                   kv_cache_usage=min(1.0, self.model.used_tokens / capacity),
                                   prefix_cache_tokens=self.model.cache_tokens,
                                   prefix_cache_hit_rate=self.model.hit_rate)

    def _tokens(self, row: RowSpec, count: int) -> tuple[list[int], list[float]]:
        """The row's next ``count`` tokens and logprobs; the response's natural last one is EOS."""
        start = row.completion_index
        ids: list[int] = []
        logprobs: list[float] = []
        index = start
        while index < start + count:
            block, ids_block, lps_block = self._block(row.request_id, row.seed, index // _BLOCK)
            offset = index - block * _BLOCK
            take = min(_BLOCK - offset, start + count - index)
            ids += ids_block[offset:offset + take]
            logprobs += lps_block[offset:offset + take]
            index += take
        if not row.sampling.ignore_eos and start + count >= self._targets[row.request_id]:
            last = max(start, self._targets[row.request_id] - 1) - start
            del ids[last + 1:], logprobs[last + 1:]
            ids[last] = self.config.eos_token_id
        return ids, logprobs

    def _block(self, request_id: str, seed: int, block: int) -> tuple[int, list[int], list[float]]:
        cached = self._blocks.get(request_id)
        if cached is not None and cached[0] == block:
            return cached
        rng = random.Random(mix_seed(seed, block))
        eos, span = self.config.eos_token_id, self.config.vocab_size - 1
        draws = array.array("I", rng.randbytes(4 * _BLOCK))
        ids = [d % span for d in draws]
        ids = [t + 1 if t >= eos else t for t in ids]
        noise = array.array("I", random.Random(mix_seed(seed ^ _LOGPROB_SALT, block)).randbytes(4 * _BLOCK))
        logprobs = [-4.0 * n / 4294967296.0 for n in noise]
        self._blocks[request_id] = cached = (block, ids, logprobs)
        return cached

    # ---------------------------------------------------------------- weights
    def weight_spec(self) -> list[WeightSpec]:
        return list(self.config.weight_spec)

    def _spec_bytes(self) -> int:
        sizes = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1}
        return sum(math.prod(s.shape) * sizes.get(s.dtype, 4) for s in self.config.weight_spec)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        if not self._weights_resident or not self._weights_loaded or self._store is None:
            raise EngineUnavailable("weights are not resident or not loaded")
        if self._store is _LAZY:
            self._store = self._initial_weights()
        return iter(list(self._store.items()))

    def _initial_weights(self) -> dict[str, Any]:
        import torch  # only when someone actually reads synthetic weights

        generator = torch.Generator().manual_seed(self.config.seed)
        return {
            s.name: torch.randn(s.shape, generator=generator).to(getattr(torch, s.dtype))
            for s in self.config.weight_spec
        }

    def _check_weights(self, named_tensors: Mapping[str, Any], require_complete: bool) -> None:
        spec = {s.name: s for s in self.config.weight_spec}
        problems = []
        for name, tensor in named_tensors.items():
            if name not in spec:
                problems.append(f"unknown weight {name!r}")
                continue
            shape = tuple(getattr(tensor, "shape", ()))
            dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
            if shape != spec[name].shape or dtype != spec[name].dtype:
                problems.append(f"{name}: {dtype}{list(shape)} != expected {spec[name].dtype}{list(spec[name].shape)}")
        if require_complete and set(spec) - set(named_tensors):
            problems.append(f"missing {sorted(set(spec) - set(named_tensors))}; a complete set is required")
        if problems:
            raise WeightMismatch("weights do not match the synthetic model: " + "; ".join(problems[:5]))

    async def _flush_cache(self) -> None:
        if self.model is not None:
            self.model.clear()   # idle blocks go; those running requests hold go when they end

    async def _swap_weights(self, named_tensors: Mapping[str, Any]) -> None:
        if self.model is not None:
            self.model.clear()
        if self._store is _LAZY:
            self._store = self._initial_weights()
        elif self._store is None:
            self._store = {}
        self._store.update(named_tensors)

    async def _release_weights(self, level: int) -> int:
        if self.model is not None:
            self.model.clear()
        freed = 0
        if self._weights_resident:
            freed = self._spec_bytes()
            self._host = self._store if level == 1 else None
            self._store = None
        elif level == 2 and self._host is not None:
            freed = self._spec_bytes()
            self._host = None
        return freed

    async def _restore_weights(self) -> bool:
        self._store, self._host = self._host, None
        return self._store is not None
