"""A stand-in for vLLM's ``AsyncLLM`` for the vLLM backend's tests.

It implements only the calls the backend makes, with vLLM's names,
signatures and result shapes (``vllm/engine/protocol.py``,
``vllm/v1/engine/async_llm.py``, ``vllm/outputs.py``,
``vllm/sampling_params.py``), and records every call in order. Generation is
scripted: token ``i`` of a request is ``script[i]`` (default ``10 + i``) with
log-probability ``-(i + 1) / 10``. In ``auto`` mode a request runs to the
end at once; otherwise the test releases tokens with :meth:`FakeAsyncLLM.emit`.

Where the backend depends on vLLM 0.33's behaviour, the fake behaves so:
requests that arrive while the scheduler is paused (``pause_generation`` in
any mode, or ``sleep``) are accepted and wait, producing nothing until it
runs again (async_llm.py: "New generation/encoding requests will not be
scheduled until resume is called"); a request id already running is
accepted (vLLM gives each request an internal id of its own);
``collective_rpc`` arguments go through a msgpack-like round trip (tuples
arrive as lists, objects msgpack cannot carry are refused) and run the real
:class:`RollmeshWorkerExtension` against a stand-in worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from replica_agent.engines.vllm_config import VllmApi
from replica_agent.engines.vllm_worker import DEVICE_MEMORY_USED, RollmeshWorkerExtension


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class EngineDeadError(Exception):
    """Same name as ``vllm.v1.engine.exceptions.EngineDeadError``."""


class EngineGenerateError(Exception):
    """``vllm.v1.engine.exceptions.EngineGenerateError``: ``generate`` wraps every failure that is neither a
    validation error nor a dead engine in it (``raise EngineGenerateError() from e``)."""


class VLLMValidationError(ValueError):
    """``vllm.exceptions.VLLMValidationError``: what vLLM's request validation raises."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter, self.value = parameter, value


class RetryableRequestError(Exception):
    """Same name as vLLM's error for a request the engine cannot take now but may later."""


INT64_MAX = 2**63 - 1


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """The fields of ``vllm.SamplingParams`` the backend sets, with vLLM's defaults and checks."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.",
                                      parameter="temperature", value=self.temperature)
        if self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.",
                                      parameter="top_k", value=self.top_k)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.",
                                      parameter="max_tokens", value=self.max_tokens)
        if self.logprobs is not None and self.logprobs < 0:
            raise VLLMValidationError(f"logprobs must be non-negative, got {self.logprobs}.",
                                      parameter="logprobs", value=self.logprobs)


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestStateStats:
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStateStats | None = None


@dataclasses.dataclass
class ModelConfig:
    dtype: str = "bfloat16"
    max_model_len: int = 512
    vocab_size: int = 256
    quantization: str | None = None

    def get_vocab_size(self) -> int:
        return self.vocab_size


@dataclasses.dataclass
class CacheConfig:
    num_gpu_blocks: int | None = 64
    block_size: int = 16


@dataclasses.dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig


@dataclasses.dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    produced: int = 0
    finished: bool = False
    deferred: int = 0
    """Tokens ``auto`` mode owes the request once the scheduler runs again."""


def msgpack_round_trip(value: Any) -> Any:
    """What crossing vLLM's msgpack encoder to the workers does to ``collective_rpc`` arguments: tuples
    become lists, tensors and plain values pass, anything else is refused."""
    if isinstance(value, (list, tuple)):
        return [msgpack_round_trip(v) for v in value]
    if isinstance(value, dict):
        return {str(k): msgpack_round_trip(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str, bytes)) or type(value).__name__ == "Tensor":
        return value
    raise TypeError(f"msgpack cannot serialize {type(value).__name__}")


class _Model:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, Any]] = []

    def load_weights(self, weights):
        self.loaded.extend(weights)
        return {name for name, _ in weights}


class _ModelRunner:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model = _Model()
        self.model_config = model_config
        self.reloaded: list[tuple[str, Any]] = []

    def reload_weights(self, weights_iterator=None, process_weights_after_loading: bool = True) -> None:
        self.reloaded.extend(weights_iterator)


class FakeWorker(RollmeshWorkerExtension):
    """A GPU worker with rollmesh's extension mixed in, as vLLM's ``worker_extension_cls`` does."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_runner = _ModelRunner(model_config)


class FakeAsyncLLM:
    """Records ``calls`` as ``(method, arguments)``; see the module docstring."""

    def __init__(self, *, auto: bool = True, eos_token_id: int = 2, abort_emits_final: bool = True) -> None:
        self.model_config = ModelConfig()
        self.vllm_config = VllmConfig(self.model_config, CacheConfig())
        self.auto = auto
        self.eos_token_id = eos_token_id
        self.abort_emits_final = abort_emits_final
        self.script: dict[str, list[int]] = {}
        self.queue_stats: RequestStateStats | None = None
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.requests: dict[str, _Request] = {}
        self.loaded: dict[str, Any] = {}
        self.errored = False
        self.fail_generate: BaseException | None = None
        self.generate_started = asyncio.Event()
        self.aborted = asyncio.Event()
        self.paused = asyncio.Event()
        self.weight_bytes, self.kv_bytes, self.other_bytes = 3000, 5000, 700
        self._weights_on_device = True
        self._kv_on_device = True
        self._sleeping = False
        self._paused = False
        self.preempted: list[str] = []
        self.worker = FakeWorker(self.model_config)

    def names(self) -> list[str]:
        """The recorded method names, in call order."""
        return [name for name, _ in self.calls]

    # -------------------------------------------------------------- generation
    async def generate(
        self,
        prompt: dict[str, Any],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ):
        call = {"prompt": prompt, "sampling_params": sampling_params, "request_id": request_id}
        self.calls.append(("generate", call))
        try:
            if self.fail_generate is not None:
                raise self.fail_generate
            if sampling_params.seed is not None and not 0 <= sampling_params.seed <= INT64_MAX:
                # the model runner keeps seeds in an int64 array
                raise OverflowError(f"Python int {sampling_params.seed} too large to convert to int64")
        except (VLLMValidationError, EngineDeadError):   # generate re-raises these as they are ...
            raise
        except Exception as exc:                          # ... and wraps every other failure
            raise EngineGenerateError() from exc
        request = _Request(list(prompt["prompt_token_ids"]), sampling_params, asyncio.Queue())
        self.requests[request_id] = request
        self.generate_started.set()
        if self.auto:
            if self._paused:   # accepted, but not scheduled until the scheduler runs again
                request.deferred = sampling_params.max_tokens or 16
            else:
                self.emit(request_id, sampling_params.max_tokens or 16)
        try:
            while True:
                out = await request.queue.get()
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.calls.append(("internal_abort", {"request_id": request_id}))
            request.finished = True
            raise

    def emit(self, request_id: str, count: int) -> None:
        """Produce up to ``count`` more tokens of ``request_id``, one output each."""
        request = self.requests[request_id]
        script = self.script.get(request_id)
        for _ in range(count):
            if request.finished:
                return
            i = request.produced
            token = script[i] if script is not None and i < len(script) else 10 + i
            request.produced += 1
            params = request.params
            reason = None
            if token in (params.stop_token_ids or []) or (token == self.eos_token_id and not params.ignore_eos):
                reason = "stop"
            elif params.max_tokens is not None and request.produced >= params.max_tokens:
                reason = "length"
            logprobs = [{token: Logprob(-(i + 1) / 10, rank=1)}] if params.logprobs is not None else None
            self._push(request_id, [token], logprobs, reason)

    def _push(self, request_id: str, tokens: list[int], logprobs: Any, reason: str | None) -> None:
        request = self.requests[request_id]
        request.finished = reason is not None
        completion = CompletionOutput(0, "", tokens, None, logprobs, reason)
        request.queue.put_nowait(
            RequestOutput(
                request_id, None, request.prompt_token_ids, None, [completion], reason is not None, self.queue_stats
            )
        )

    def live(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if not r.finished]

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.calls.append(("abort", {"request_id": ids}))
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.finished:
                continue
            if self.abort_emits_final:
                self._push(rid, [], None, "abort")
            else:
                request.finished = True
        self.aborted.set()

    # ----------------------------------------------------------- pause / sleep
    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", {"mode": mode, "clear_cache": clear_cache}))
        if mode == "abort":
            for rid in self.live():
                self._push(rid, [], None, "abort")
        if clear_cache:   # the kept requests give their KV blocks up and recompute them when resumed
            self.preempted += [rid for rid in self.live() if rid not in self.preempted]
        self._paused = True
        self.paused.set()

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", {}))
        self._run_scheduler()

    def _run_scheduler(self) -> None:
        self._paused = False
        for rid, request in list(self.requests.items()):
            if request.deferred and not request.finished:
                count, request.deferred = request.deferred, 0
                self.emit(rid, count)

    async def is_paused(self) -> bool:
        return self._paused

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", {"level": level}))
        self._weights_on_device = self._kv_on_device = False
        self._sleeping = True
        self._paused = True   # the engine core pauses its scheduler to sleep

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", {"tags": tags}))
        for tag in tags or ["weights", "kv_cache"]:
            if tag == "weights":
                self._weights_on_device = True
            elif tag == "kv_cache":
                self._kv_on_device = True
            else:
                raise ValueError(f"unknown tag {tag}")
        self._sleeping = not (self._weights_on_device and self._kv_on_device)
        if not self._sleeping:
            self._run_scheduler()   # a full wake-up restarts the scheduler, even after an explicit pause

    async def is_sleeping(self) -> bool:
        return self._sleeping or self._paused   # as the engine core answers it: True while only paused too

    # ----------------------------------------------------------------- weights
    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        self.calls.append(("collective_rpc", {"method": method, "args": args, "kwargs": kwargs}))
        args, kwargs = msgpack_round_trip(args), msgpack_round_trip(kwargs or {})
        if method.startswith("rollmesh_load"):
            before = len(self.worker.model_runner.model.loaded) + len(self.worker.model_runner.reloaded)
            count = getattr(self.worker, method)(*args, **kwargs)
            runner = self.worker.model_runner
            for name, tensor in (runner.model.loaded + runner.reloaded)[before:]:
                self.loaded[name] = tensor
            return [count]
        if method == DEVICE_MEMORY_USED:
            used = self.other_bytes
            used += self.weight_bytes if self._weights_on_device else 0
            used += self.kv_bytes if self._kv_on_device else 0
            return [used]
        raise AttributeError(f"worker has no method {method!r}")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """As block_pool.py: False while any KV block is in use, unless the running requests are preempted
        (``reset_running_requests``), which frees their blocks (they recompute their KV when rescheduled)."""
        self.calls.append(("reset_prefix_cache", {"reset_running_requests": True} if reset_running_requests else {}))
        holding = [rid for rid in self.live() if rid not in self.preempted]
        if holding and not reset_running_requests:
            return False
        self.preempted += holding
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("shutdown", {}))


def fake_api(engine: FakeAsyncLLM, created_with: list[dict[str, Any]] | None = None) -> VllmApi:
    """A :class:`VllmApi` whose ``create_client`` returns ``engine`` (recording the engine arguments)."""

    def create_client(kwargs: dict[str, Any]) -> FakeAsyncLLM:
        if created_with is not None:
            created_with.append(dict(kwargs))
        return engine

    return VllmApi(create_client, SamplingParams, RequestOutputKind.DELTA)
