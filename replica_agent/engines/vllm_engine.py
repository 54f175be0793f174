"""``VllmEngine``: a replica served by vLLM's in-process async engine.

The engine drives ``vllm.v1.engine.async_llm.AsyncLLM`` (built with
``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``) through the calls of
vLLM's ``EngineClient`` protocol (``vllm/engine/protocol.py``) and the RL
pages of its documentation:

===================  =========================================================
rollmesh             vLLM
===================  =========================================================
``generate``         ``generate(prompt={"prompt_token_ids": ...},
                     sampling_params=SamplingParams(..., output_kind=DELTA),
                     request_id=...)``
``abort``            ``abort(request_ids)``
``pause``/``resume`` ``pause_generation(mode=..., clear_cache=False)`` /
                     ``resume_generation()`` (docs/training/async_rl.md), plus
                     an agent-level gate: vLLM does not schedule requests that
                     arrive while it is paused; rollmesh refuses them first,
                     with a status the balancer retries elsewhere
``sleep``            ``abort`` of everything in flight, then ``sleep(level=)``
                     (docs/features/sleep_mode.md; needs
                     ``enable_sleep_mode=True``); vLLM's sleep also pauses its
                     scheduler
``wake_up``          ``wake_up(tags=["weights", "kv_cache"])``; a full wake-up
                     restarts vLLM's scheduler, even after an explicit pause
``load_weights``     ``pause_generation(mode="keep")``, then
                     ``collective_rpc("rollmesh_load_weights", kwargs=...)``
                     per bucket (a worker extension calling
                     ``model_runner.model.load_weights``), then
                     ``reset_prefix_cache()`` and ``resume_generation()``
===================  =========================================================

vLLM is imported only by :func:`load_vllm_api`, when :meth:`VllmEngine.start`
runs without an injected :class:`VllmApi`; importing this module needs
neither vllm nor torch. vLLM keeps the weights in worker processes, fused and
sharded, so the Hugging Face view (:meth:`VllmEngine.weight_spec`,
:meth:`VllmEngine.named_weights`) comes from the checkpoint's safetensors
headers and from the tensors this engine installed (see
:mod:`served_weights`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mesh_runtime.reasons import Reason
from .base import WAKE_TAGS, Engine, LifecycleFlags, PauseMode
from .checkpoint_spec import checkpoint_files
from .errors import (
    CacheInUse,
    DuplicateRequest,
    EngineDead,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
)
from .metrics import EngineMetrics
from .remote_streams import RemoteStreams
from .randomness import mix_seed
from .types import (
    FinishReason,
    EngineRequest,
    LoadSnapshot,
    validate_request,
)
from .vllm_config import VllmApi, VllmEngineConfig, load_vllm_api
from .delta_stream import RequestStream
from .served_weights import WeightCatalog, weight_buckets
from .vllm_worker import DEVICE_MEMORY_USED, LOAD_WEIGHTS

log = logging.getLogger(__name__)

MAX_VLLM_TEMPERATURE = 2.0
"""vLLM's ``SamplingParams`` rejects temperatures above 2 (vllm/sampling_params.py)."""


def _named(exc: BaseException | None, *names: str) -> bool:
    """Whether ``exc`` is an instance of a class called one of ``names`` (vLLM's exceptions are matched
    by name, so that this module never imports vllm)."""
    return exc is not None and any(cls.__name__ in names for cls in type(exc).__mro__)


def _is_engine_dead_error(exc: BaseException) -> bool:
    """vLLM's ``EngineDeadError`` (vllm/v1/engine/exceptions.py)."""
    return _named(exc, "EngineDeadError")


_VALIDATION_ERRORS = ("VLLMValidationError", "VLLMClientError")
"""vLLM's request-validation errors (vllm/exceptions.py); ``generate`` re-raises them as they are and wraps
any other failure in ``EngineGenerateError`` (vllm/v1/engine/async_llm.py)."""


def vllm_failure(exc: BaseException, request_id: str) -> EngineError:
    """What a vLLM ``generate`` failure means for the caller: a request vLLM rejected (also when wrapped in
    ``EngineGenerateError``) is ``InvalidRequest``; ``RetryableRequestError`` is ``EngineUnavailable`` (try
    again, or elsewhere); anything else failed the generation."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__
    if any(_named(e, *_VALIDATION_ERRORS) for e in chain):
        rejected = next(e for e in chain if _named(e, *_VALIDATION_ERRORS))
        return InvalidRequest(f"vllm rejected request {request_id}: {rejected}")
    retryable = next((e for e in chain if _named(e, "RetryableRequestError")), None)
    if retryable is not None:
        return EngineUnavailable(f"vllm could not take request {request_id} now: {retryable}", reason=Reason.RETRYABLE)
    if not _named(exc, "EngineGenerateError") and isinstance(exc, ValueError):   # a vLLM without the classes
        return InvalidRequest(f"vllm rejected request {request_id}: {exc}")
    detail = f"{exc!r}" + (f" (caused by {chain[-1]!r})" if len(chain) > 1 else "")
    return EngineError(f"vllm failed request {request_id}: {detail}", reason=Reason.GENERATION_FAILED)


MAX_VLLM_SEED = 2**63 - 1
"""vLLM keeps per-request seeds in int64 arrays (v1/worker/gpu/sample/states.py); rollmesh's are uint64."""


class VllmEngine(RemoteStreams, LifecycleFlags, Engine):
    """Continuous batching, sleep mode and weight updates delegated to vLLM."""

    engine_name = "vllm"

    def __init__(
        self,
        config: VllmEngineConfig,
        *,
        api: VllmApi | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self.replica_id = config.replica_id
        self.node_id = config.node_id
        self.memory_fraction = config.memory_fraction
        self._api = api
        self._clock = clock
        self._metrics = EngineMetrics(clock)
        self._client: Any = None
        self._requests: dict[str, RequestStream] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._control = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self._dead: BaseException | None = None
        self._paused = False
        self._vllm_paused = False
        self._weights_resident = True
        self._kv_resident = True
        self._weights_loaded = True
        self._weight_version = config.weight_version
        self._catalog: WeightCatalog | None = None
        self._vocab_size: int | None = None
        self._max_model_len: int | None = None
        self._kv_capacity = 0
        self._reload = False

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise EngineDead("engine is closed")
        try:
            checkpoint_files(self.config.model_path)  # fail before starting vLLM if there is no checkpoint
            api = self._api or load_vllm_api()
            # Off the event loop: building vLLM's engine (loading the model, capturing CUDA graphs) takes
            # minutes, and health checks and lease reports must go on meanwhile.
            client = await asyncio.to_thread(api.create_client, self.config.engine_kwargs())
            if inspect.isawaitable(client):
                client = await client
            self._api, self._client = api, client
            self._describe_model(client)
        except Exception as exc:
            self._dead = exc
            await self._shutdown()
            if isinstance(exc, EngineError):
                raise
            raise EngineDead(f"vllm engine failed to start: {exc!r}") from exc
        self._started = True
        log.info(
            "vllm engine %r: %s, %d weights, %d KV tokens",
            self.replica_id, self.config.model_path, len(self.catalog.spec), self._kv_capacity,
        )

    @property
    def api(self) -> VllmApi:
        """vLLM's API as loaded by ``start`` (EngineUnavailable before it)."""
        if self._api is None:
            raise EngineUnavailable("engine is still loading")
        return self._api

    def _describe_model(self, client: Any) -> None:
        model_config = client.model_config
        served = str(model_config.dtype).removeprefix("torch.")
        self._catalog = WeightCatalog(self.config.model_path, served, keep_tensors=self.config.keep_host_weights)
        self._max_model_len = int(model_config.max_model_len)
        quantized = getattr(model_config, "quantization", None) is not None
        self._reload = (self.config.weight_loader == "reload_weights"
                        or (self.config.weight_loader == "auto" and quantized))
        self._vocab_size = int(model_config.get_vocab_size())
        cache = getattr(getattr(client, "vllm_config", None), "cache_config", None)
        blocks, block_size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        if isinstance(blocks, int) and isinstance(block_size, int) and blocks > 0:
            self._kv_capacity = blocks * block_size
        else:
            self._kv_capacity = self._max_model_len * self.config.max_batch_size

    async def _shutdown(self) -> None:
        """``AsyncLLM.shutdown()`` stops the engine-core and worker processes;
        it blocks while they exit, so it runs off the event loop."""
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.to_thread(client.shutdown)
            except Exception:  # noqa: BLE001 - closing must not fail
                log.exception("vllm engine %r: shutdown failed", self.replica_id)

    def _check_alive(self) -> None:
        if self._dead is None and self._client is not None and self._client.errored:
            self._mark_dead(RuntimeError("the vllm engine core died"))
        super()._check_alive()

    async def _call(self, what: str, awaitable: Any) -> Any:
        """Await one vLLM call, translating its failures."""
        try:
            return await awaitable
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if _is_engine_dead_error(exc):
                self._mark_dead(exc)
                raise EngineDead(f"vllm engine died during {what}") from exc
            raise EngineError(f"vllm {what} failed: {exc!r}", reason=Reason.VLLM_CALL_FAILED) from exc

    # ------------------------------------------------------------- generation
    def _submit(self, request: EngineRequest) -> RequestStream:
        self._check_alive()
        validate_request(request, vocab_size=self._vocab_size, max_model_len=self._max_model_len)
        if request.sampling.temperature > MAX_VLLM_TEMPERATURE:
            raise InvalidRequest(
                f"the vllm backend accepts temperature <= {MAX_VLLM_TEMPERATURE}, got {request.sampling.temperature}"
            )
        self._check_serving()
        previous = self._requests.get(request.request_id)
        if previous is not None and not previous.done.is_set():
            raise DuplicateRequest(f"request {request.request_id} is already in flight")
        stream = RequestStream(
            request,
            stream_interval=self.config.stream_interval,
            flush_interval_s=self.config.flush_interval_s,
            replica_id=self.replica_id,
            node_id=self.node_id,
            clock=self._clock,
            metrics=self._metrics,
        )
        try:
            params = self._sampling_params(stream)
        except Exception as exc:  # vLLM's SamplingParams validates its arguments (VLLMValidationError)
            failure = vllm_failure(exc, request.request_id)
            if not isinstance(failure, InvalidRequest):
                raise failure from exc
            raise InvalidRequest(f"vllm rejected the sampling parameters of {request.request_id}: {exc}") from exc
        self._requests[request.request_id] = stream
        self._idle.clear()
        stream.task = self._spawn(self._consume(stream, params), name=f"vllm-{request.request_id}")
        return stream

    def _sampling_params(self, stream: RequestStream) -> Any:
        sp = stream.request.sampling
        seed = sp.seed
        if seed is not None and stream.prefix:
            # vLLM seeds one generator per request, so the continuation cannot
            # replay the draws of an uninterrupted run; derive a fresh stream.
            seed = mix_seed(seed, len(stream.prefix))
        if seed is not None:
            seed &= MAX_VLLM_SEED   # a uint64 seed folded into vLLM's int64 range: the same seed, the same draws
        return self.api.sampling_params(
            n=1,
            max_tokens=stream.budget,
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            top_k=max(0, sp.top_k),  # vLLM: 0 (or -1) considers all tokens
            seed=seed,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            logprobs=0 if sp.logprobs else None,  # 0: only the sampled token's logprob
            output_kind=self.api.delta_output_kind,
            detokenize=False,
        )

    async def _consume(self, stream: RequestStream, params: Any) -> None:
        """Feed vLLM's output stream for ``stream`` into it until it is final."""
        outputs = None
        try:
            if stream.abort_requested:
                stream.finish(FinishReason.ABORTED, self._weight_version)
                return
            outputs = self._client.generate(
                prompt={"prompt_token_ids": stream.context},
                sampling_params=params,
                request_id=stream.request_id,
            )
            async for output in outputs:
                if stream.accept(output, self._weight_version) and not output.finished:
                    break  # ended early (budget): closing vLLM's generator aborts the request
            stream.finish(FinishReason.ABORTED, self._weight_version)  # no-op unless vLLM ended silently
        except asyncio.CancelledError:
            stream.finish(FinishReason.ABORTED, self._weight_version)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must reach the consumer
            if _is_engine_dead_error(exc) or (exc.__cause__ is not None and _is_engine_dead_error(exc.__cause__)):
                self._mark_dead(exc)
            elif isinstance(exc, EngineError):
                stream.fail(exc)
            else:
                stream.fail(vllm_failure(exc, stream.request_id))
        finally:
            if outputs is not None:
                try:
                    await outputs.aclose()
                except Exception:  # noqa: BLE001 - the stream has already ended
                    log.debug("closing vllm's output stream of %s failed", stream.request_id, exc_info=True)
            self._retire(stream)

    async def _abort_remote(self, request_ids: list[str]) -> None:
        await self._call("abort", self._client.abort(request_ids))

    # ---------------------------------------------------------- pause / sleep
    async def pause(self, mode: PauseMode = "wait") -> None:
        if mode not in ("wait", "abort"):
            raise InvalidRequest(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._check_alive()
        self._paused = True
        if mode == "abort":
            await self.abort(None)
        await self._call("pause_generation", self._client.pause_generation(mode=mode, clear_cache=False))
        self._vllm_paused = True
        await self._idle.wait()

    async def resume(self) -> None:
        self._check_alive()
        self._paused = False
        await self._release_vllm_pause()

    async def _release_vllm_pause(self) -> None:
        """Resume vLLM's scheduler once nothing requires it to stay paused."""
        if self._vllm_paused and not self._paused and self._weights_resident and self._kv_resident:
            await self._call("resume_generation", self._client.resume_generation())
            self._vllm_paused = False

    async def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level!r}")
        self._check_alive()
        async with self._control:
            anything_resident = self._weights_resident or self._kv_resident
            self._kv_resident = False  # refuses new requests from here on
            await self.abort(None)
            freed = 0
            if anything_resident:
                before = await self._device_memory_used()
                await self._call("sleep", self._client.sleep(level=level))
                after = await self._device_memory_used()
                if before is not None and after is not None:
                    freed = max(0, before - after)
            # Deepening a finished level-1 sleep frees no device memory (vLLM
            # keeps its host copy), but the weights must now be reloaded.
            self._weights_resident = False
            self._vllm_paused = True   # vLLM's sleep pauses its scheduler too
            if level == 2:
                self._weights_loaded = False
            return freed

    async def _device_memory_used(self) -> int | None:
        """Device bytes in use, summed over the workers (one per GPU)."""
        try:
            used = await self._call("collective_rpc", self._client.collective_rpc(DEVICE_MEMORY_USED))
            return int(sum(used))
        except EngineDead:
            raise
        except (EngineError, TypeError, ValueError) as exc:
            log.warning("vllm engine %r: cannot read device memory: %s", self.replica_id, exc)
            return None

    async def wake_up(self, tags: set[str] | None = None) -> None:
        tags = set(tags) if tags else set(WAKE_TAGS)
        unknown = tags - WAKE_TAGS
        if unknown:
            raise InvalidRequest(f"unknown wake_up tags {sorted(unknown)}; expected a subset of {sorted(WAKE_TAGS)}")
        self._check_alive()
        async with self._control:
            asleep = {"weights": not self._weights_resident, "kv_cache": not self._kv_resident}
            wake = [tag for tag in ("weights", "kv_cache") if tag in tags and asleep[tag]]
            if wake:
                await self._call("wake_up", self._client.wake_up(tags=wake))
            if "weights" in wake:
                self._weights_resident = True  # after level 2 the contents are garbage: _weights_loaded stays False
            if "kv_cache" in wake:
                self._kv_resident = True
            if wake and self._weights_resident and self._kv_resident:
                self._vllm_paused = False   # a full wake-up restarts vLLM's scheduler, explicit pause or not
                if self._paused:            # ... so a replica paused on purpose is paused in vLLM again
                    await self._call("pause_generation", self._client.pause_generation(mode="wait",
                                                                                      clear_cache=False))
                    self._vllm_paused = True
            await self._release_vllm_pause()

    async def is_sleeping(self) -> bool:
        """True while any memory tag sleeps. Kept here, not asked of vLLM: its ``is_sleeping()`` is also
        True for an engine that is only paused."""
        self._check_alive()
        return not (self._weights_resident and self._kv_resident)

    # ---------------------------------------------------------------- weights
    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        self._check_version(version)
        self._check_alive()
        async with self._control:
            self._check_update(named_tensors)
            # Freeze in-flight requests (docs/training/async_rl.md); they
            # resume under the new weights. Needless while asleep or paused.
            freeze = self._kv_resident and not self._vllm_paused
            try:
                if freeze:
                    clear = self.config.recompute_kv_after_weight_update
                    await self._call("pause_generation", self._client.pause_generation(mode="keep", clear_cache=clear))
                    # One loop turn: every stream consumer pulls the outputs vLLM
                    # delivered before the freeze, so they are tagged with the
                    # old version (vLLM's own pause_generation yields for the
                    # same ordering reason).
                    await asyncio.sleep(0)
                for bucket in weight_buckets(named_tensors.items(), self.config.weight_bucket_bytes):
                    rpc = self._client.collective_rpc(LOAD_WEIGHTS, kwargs={"weights": bucket,
                                                                            "reload": self._reload})
                    await self._call("collective_rpc", rpc)
                await self._reset_prefix_cache()
            except BaseException:
                # Some buckets may have landed: serve nothing until a complete load.
                self._weights_loaded = False
                if self._dead is None:
                    await self.abort(None)
                    if freeze:
                        await self._resume_after_failure()
                raise
            self._weight_version = version
            self._weights_loaded = True
            self.catalog.record(named_tensors)
            if freeze:
                await self._call("resume_generation", self._client.resume_generation())

    async def flush_cache(self) -> None:
        self._check_alive()
        if await self._call("reset_prefix_cache", self._client.reset_prefix_cache()) is False:
            raise CacheInUse("vllm keeps its prefix cache while running requests hold blocks of it; flush when "
                             "they have ended")

    async def _reset_prefix_cache(self) -> None:
        """Drop every prefix block computed with the old weights, or fail the load.

        vLLM's ``reset_prefix_cache()`` returns False while any KV block is in use (block_pool.py): the
        requests frozen through the load hold theirs. Then the running requests are preempted so the
        reset can happen (``reset_running_requests=True``; they recompute their KV under the new weights):
        a new request must never reuse a prompt prefix computed with the old ones, and GRPO groups share
        prompts.
        """
        if await self._call("reset_prefix_cache", self._client.reset_prefix_cache()) is not False:
            return
        log.info("vllm engine %r: prefix cache still in use after a weight load; preempting the running "
                 "requests to reset it (they recompute their KV with the new weights)", self.replica_id)
        done = await self._call("reset_prefix_cache", self._client.reset_prefix_cache(reset_running_requests=True))
        if done is False:
            raise EngineError("vllm could not reset its prefix cache after a weight load: blocks computed with "
                              "the old weights would be reused", reason=Reason.PREFIX_CACHE_NOT_RESET)

    async def _resume_after_failure(self) -> None:
        try:
            await self._call("resume_generation", self._client.resume_generation())
        except EngineError as exc:
            log.warning("vllm engine %r: resume after a failed weight load failed: %s", self.replica_id, exc)

    # ---------------------------------------------------------------- metrics
    def load_snapshot(self) -> LoadSnapshot:
        """Figures tracked from the streamed outputs (vLLM's stat-logger
        interface is documented as unstable): a request counts as running
        once vLLM has produced its first output, as waiting before."""
        streams = [s for s in self._requests.values() if not s.done.is_set()]
        running = sum(1 for s in streams if s.admitted)
        used = sum(s.held_tokens for s in streams)
        capacity = max(1, self._kv_capacity)
        itl_mean, itl_p95 = self._metrics.itl_stats()
        return LoadSnapshot(
            running=running,
            waiting=len(streams) - running,
            kv_cache_usage=min(1.0, used / capacity),
            max_total_tokens=self._kv_capacity,
            used_tokens=used,
            tokens_per_second=self._metrics.tokens_per_second(),
            queue_time_p95_s=self._metrics.queue_time_p95(),
            ttft_p95_s=self._metrics.ttft_p95(),
            itl_mean_s=itl_mean,
            itl_p95_s=itl_p95,
        )
