"""``SglangEngine``: a replica served by an SGLang server, driven over its HTTP API.

===================  =========================================================
rollmesh             SGLang 0.5.x
===================  =========================================================
``start``            launch ``sglang.launch_server`` (or attach to ``url``),
                     then wait for ``/health``
``generate``         ``/generate`` with ``input_ids``, ``sampling_params``,
                     ``rid``, ``stream: true`` (:mod:`sglang_http`)
``abort``            ``/abort_request {"rid"}`` per request
``pause``/``resume`` an agent-level gate (no new request reaches the server);
                     ``"abort"`` mode aborts this replica's requests first
``sleep``            aborts, then ``/release_memory_occupation`` (all tags);
                     level 1 needs the server's weight host backup
``wake_up``          ``/resume_memory_occupation {"tags"}``
``load_weights``     ``/pause_generation {"mode": "retract"}`` while requests
                     run (they recompute their KV under the new weights), the
                     update group (:mod:`sglang_weights`) and
                     ``/update_weights_from_distributed`` per bucket with
                     ``flush_cache`` on the last, ``/continue_generation``
``load_snapshot``    ``/metrics`` (``sglang:num_running_reqs``,
                     ``sglang:num_queue_reqs``, ``sglang:token_usage``,
                     queue-time and TTFT histograms), read in the background
===================  =========================================================

The Hugging Face view of the weights (:meth:`weight_spec`,
:meth:`named_weights`) comes from the checkpoint's safetensors headers and the
tensors this engine installed, as for vLLM (:mod:`served_weights`).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any

from mesh_runtime.net import free_port
from mesh_runtime.reasons import Reason

from .base import WAKE_TAGS, Engine, LifecycleFlags, PauseMode
from .delta_stream import RequestStream
from .errors import CacheInUse, DuplicateRequest, EngineDead, EngineError, EngineUnavailable, InvalidRequest
from .metrics import EngineMetrics
from .remote_streams import RemoteStreams
from .randomness import mix_seed
from .served_weights import WeightCatalog, weight_buckets
from .sglang_config import SglangEngineConfig, model_dtype, model_limits
from .sglang_http import SglangClient, finish_reason, new_tokens
from .sglang_load import ServerLoad
from .sglang_weights import WeightUpdateGroup, update_request, weight_bytes
from .types import FinishReason, EngineRequest, LoadSnapshot, validate_request

log = logging.getLogger(__name__)

MAX_SGLANG_SEED = 2**63 - 1
BUCKET_BYTES = 256 << 20


class SglangEngine(RemoteStreams, LifecycleFlags, Engine):
    """Continuous batching, memory release and weight updates delegated to an SGLang server."""

    engine_name = "sglang"

    def __init__(self, config: SglangEngineConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        self.config = config
        self.replica_id, self.node_id = config.replica_id, config.node_id
        self.memory_fraction = config.memory_fraction
        self._clock = clock
        self._metrics = EngineMetrics(clock)
        self._client: SglangClient | None = None
        self._process: subprocess.Popen | None = None
        self._requests: dict[str, RequestStream] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._control = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._group: WeightUpdateGroup | None = None
        self._load = ServerLoad()
        self._weight_version = config.weight_version
        self._catalog: WeightCatalog | None = None
        self._vocab_size, self._max_model_len = model_limits(config.model_path)
        self._tp_size = config.tensor_parallel_size

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise EngineDead("engine is closed")
        try:
            url = self.config.url or self._launch()
            self._client = SglangClient(url, timeout_s=self.config.request_timeout_s)
            await self._wait_healthy()
            info = await self._client.get_json("/get_server_info")
            self._describe(info if isinstance(info, dict) else {})
        except Exception as exc:
            self._dead = exc
            await self._shutdown()
            if isinstance(exc, EngineError):
                raise
            raise EngineDead(f"sglang engine failed to start: {exc!r}") from exc
        self._started = True
        self._spawn(self._poll_metrics(), name=f"sglang-metrics-{self.replica_id}")
        log.info("sglang engine %r: %s at %s, %d weights", self.replica_id, self.config.model_path,
                 self.client.url, len(self.catalog.spec))

    @property
    def client(self) -> SglangClient:
        """The HTTP client of the sglang server (EngineUnavailable before ``start`` or after ``close``)."""
        if self._client is None:
            raise EngineUnavailable("the sglang server is not attached (starting, or closed)")
        return self._client

    def _launch(self) -> str:
        port = self.config.port or free_port(self.config.host)
        command = self.config.launch_command(port)
        log.info("sglang engine %r: launching %s", self.replica_id, " ".join(command[:6]))
        self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{port}"

    async def _wait_healthy(self) -> None:
        deadline = self._clock() + self.config.startup_timeout_s
        while not await self.client.healthy():
            if self._process is not None and self._process.poll() is not None:
                raise EngineDead(f"the sglang server exited with code {self._process.returncode} before it "
                                 "was healthy", reason=Reason.SGLANG_EXITED)
            if self._clock() > deadline:
                raise EngineDead(f"the sglang server at {self.client.url} was not healthy within "
                                 f"{self.config.startup_timeout_s:g} s", reason=Reason.SGLANG_NOT_HEALTHY)
            await asyncio.sleep(0.2)

    def _describe(self, info: dict[str, Any]) -> None:
        served = str(info.get("dtype") or "auto")
        if served == "auto":   # SGLang then serves the checkpoint's own dtype
            served = model_dtype(self.config.model_path) or "bfloat16"
        self._catalog = WeightCatalog(self.config.model_path, served, keep_tensors=self.config.keep_host_weights)
        tp = info.get("tp_size")
        if isinstance(tp, int) and tp >= 1:
            self._tp_size = tp
        context = info.get("context_length")
        if isinstance(context, int) and context > 0:
            self._max_model_len = context
        self._load.max_total_tokens = int(info.get("max_total_num_tokens") or 0)

    async def _shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)

    def _check_alive(self) -> None:
        if self._dead is None and self._process is not None and self._process.poll() is not None:
            self._mark_dead(RuntimeError(f"the sglang server exited with code {self._process.returncode}"))
        super()._check_alive()

    async def flush_cache(self) -> None:
        self._check_alive()
        try:
            await self._post("/flush_cache")
        except InvalidRequest as exc:   # SGLang answers 400 while requests are pending
            raise CacheInUse(str(exc)) from exc

    async def _post(self, path: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        try:
            return await self.client.post(path, body, **kw)
        except EngineDead as exc:
            self._mark_dead(exc)
            raise

    # ------------------------------------------------------------- generation
    def _submit(self, request: EngineRequest) -> RequestStream:
        self._check_alive()
        validate_request(request, vocab_size=self._vocab_size, max_model_len=self._max_model_len)
        self._check_serving()
        previous = self._requests.get(request.request_id)
        if previous is not None and not previous.done.is_set():
            raise DuplicateRequest(f"request {request.request_id} is already in flight")
        stream = RequestStream(request, stream_interval=self.config.stream_interval,
                               flush_interval_s=self.config.flush_interval_s, replica_id=self.replica_id,
                               node_id=self.node_id, clock=self._clock,
                               metrics=self._metrics)
        self._requests[request.request_id] = stream
        self._idle.clear()
        stream.task = self._spawn(self._consume(stream), name=f"sglang-{request.request_id}")
        return stream

    def _body(self, stream: RequestStream) -> dict[str, Any]:
        sp = stream.request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": stream.budget, "temperature": float(sp.temperature), "top_p": float(sp.top_p),
            "top_k": sp.top_k if sp.top_k > 0 else -1,   # SGLang: -1 considers every token
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
        }
        if sp.seed is not None:
            seed = mix_seed(sp.seed, len(stream.prefix)) if stream.prefix else sp.seed
            params["sampling_seed"] = seed & MAX_SGLANG_SEED
        return {"input_ids": stream.context, "sampling_params": params, "rid": stream.request_id,
                "stream": True, "return_logprob": bool(sp.logprobs)}

    async def _consume(self, stream: RequestStream) -> None:
        try:
            if stream.abort_requested:
                stream.finish(FinishReason.ABORTED, self._weight_version)
                return
            seen = 0
            async for event in self.client.generate(self._body(stream)):
                tokens, logprobs = new_tokens(event, seen)
                seen += len(tokens)
                finish = finish_reason(event.get("meta_info") or {})
                if stream.accept_delta(tokens, logprobs if stream.request.sampling.logprobs else [], finish,
                                       self._weight_version):
                    break
            if not stream.done.is_set() and not await self.client.healthy():
                raise EngineDead(f"the sglang server at {self.client.url} went away during request "
                                 f"{stream.request_id}", reason=Reason.SGLANG_UNREACHABLE)
            stream.finish(FinishReason.ABORTED, self._weight_version)   # no-op unless the server ended silently
        except asyncio.CancelledError:
            stream.finish(FinishReason.ABORTED, self._weight_version)
            raise
        except EngineDead as exc:
            self._mark_dead(exc)
        except EngineError as exc:
            stream.fail(exc)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the consumer
            stream.fail(EngineError(f"sglang failed request {stream.request_id}: {exc!r}",
                                    reason=Reason.GENERATION_FAILED))
        finally:
            self._retire(stream)

    async def _abort_remote(self, request_ids: list[str]) -> None:
        results = await asyncio.gather(*(self._post("/abort_request", {"rid": rid}) for rid in request_ids),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, EngineError) and not isinstance(result, EngineDead):
                log.warning("sglang engine %r: abort failed: %s", self.replica_id, result)

    # ---------------------------------------------------------- pause / sleep
    async def pause(self, mode: PauseMode = "wait") -> None:
        if mode not in ("wait", "abort"):
            raise InvalidRequest(f"pause mode must be 'wait' or 'abort', got {mode!r}")
        self._check_alive()
        self._paused = True
        if mode == "abort":
            await self.abort(None)
        await self._idle.wait()

    async def resume(self) -> None:
        self._check_alive()
        self._paused = False

    async def sleep(self, level: int = 1) -> int:
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level!r}")
        if level == 1 and not self.config.weights_cpu_backup and self._weights_resident:
            raise InvalidRequest("a level-1 sleep keeps the weights on the host: start the sglang server with "
                                 "--enable-weights-cpu-backup (engine option weights_cpu_backup: true), or "
                                 "sleep at level 2 and reload the weights")
        self._check_alive()
        async with self._control:
            resident = self._weights_resident or self._kv_resident
            weights_were_resident = self._weights_resident
            self._kv_resident = False   # refuses new requests from here on
            await self.abort(None)
            if resident:
                await self._post("/release_memory_occupation", {})
            self._weights_resident = False
            if level == 2:
                self._weights_loaded = False
            return weight_bytes(self.catalog.spec) if weights_were_resident else 0

    async def wake_up(self, tags: set[str] | None = None) -> None:
        tags = set(tags) if tags else set(WAKE_TAGS)
        unknown = tags - WAKE_TAGS
        if unknown:
            raise InvalidRequest(f"unknown wake_up tags {sorted(unknown)}; expected a subset of {sorted(WAKE_TAGS)}")
        self._check_alive()
        async with self._control:
            wake = []
            if "weights" in tags and not self._weights_resident:
                wake.append("weights")
            if "kv_cache" in tags and not self._kv_resident:
                wake += ["kv_cache", "cuda_graph"]
            if wake:
                await self._post("/resume_memory_occupation", {"tags": wake})
            if "weights" in wake:
                self._weights_resident = True
            if "kv_cache" in wake:
                self._kv_resident = True

    # ---------------------------------------------------------------- weights
    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        self._check_version(version)
        self._check_alive()
        async with self._control:
            self._check_update(named_tensors)
            retract = self._kv_resident and any(not s.done.is_set() for s in self._requests.values())
            try:
                if retract:
                    await self._post("/pause_generation", {"mode": "retract"})
                await self._update(list(named_tensors.items()))
            except BaseException:
                self._weights_loaded = False   # some buckets may have landed: serve nothing until a complete load
                if self._dead is None:
                    await self.abort(None)
                    if retract:
                        await self._continue_after_failure()
                raise
            self._weight_version = version
            self._weights_loaded = True
            self.catalog.record(named_tensors)
            if retract:
                await self._post("/continue_generation", {})

    async def _update(self, named: list[tuple[str, Any]]) -> None:
        group = await self._weight_group()
        buckets = list(weight_buckets(named, BUCKET_BYTES)) or [[]]
        try:
            for i, bucket in enumerate(buckets):
                body = update_request(bucket, group.group_name, flush_cache=i == len(buckets) - 1)
                answer, _ = await asyncio.gather(
                    self._post("/update_weights_from_distributed", body, timeout_s=self.config.request_timeout_s),
                    asyncio.to_thread(group.broadcast, bucket))
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise EngineError(f"sglang refused the weight update: {str(answer.get('message'))[:200]}",
                                      reason=Reason.WEIGHT_UPDATE_FAILED)
        except BaseException:
            self._group = None   # a broken group is never reused: the next load joins a new one
            await asyncio.to_thread(group.close)
            raise

    async def _weight_group(self) -> WeightUpdateGroup:
        if self._group is not None:
            return self._group
        group = WeightUpdateGroup(host=self.config.weight_group_host, port=self.config.weight_group_port,
                                  world_size=1 + self._tp_size, backend=self.config.weight_backend,
                                  timeout_s=self.config.request_timeout_s)
        try:
            answer, _ = await asyncio.gather(self._post("/init_weights_update_group", group.request()),
                                             asyncio.to_thread(group.join))
        except BaseException:
            await asyncio.to_thread(group.close)
            raise
        if isinstance(answer, dict) and answer.get("success") is False:
            await asyncio.to_thread(group.close)
            raise EngineError(f"sglang could not join the weight update group: {str(answer.get('message'))[:200]}",
                              reason=Reason.WEIGHT_GROUP_FAILED)
        self._group = group
        return group

    async def _continue_after_failure(self) -> None:
        try:
            await self._post("/continue_generation", {})
        except EngineError as exc:
            log.warning("sglang engine %r: continue after a failed weight load failed: %s", self.replica_id, exc)

    # ---------------------------------------------------------------- metrics
    async def _poll_metrics(self) -> None:
        while True:
            try:
                self._load.update(await self.client.get_text("/metrics"))
            except EngineDead as exc:
                self._mark_dead(exc)
                return
            except (EngineError, ValueError) as exc:
                log.debug("sglang engine %r: reading /metrics failed: %s", self.replica_id, exc)
            await asyncio.sleep(self.config.metrics_interval_s)

    def load_snapshot(self) -> LoadSnapshot:
        """Running/waiting requests, KV usage, queue time and TTFT as the server reports them (they include
        requests of other clients of an attached server); throughput and inter-token latency as measured on
        this engine's streams."""
        itl_mean, itl_p95 = self._metrics.itl_stats()
        own = sum(1 for s in self._requests.values() if not s.done.is_set())
        load = self._load
        return LoadSnapshot(
            running=load.running if load.scraped else own, waiting=load.waiting,
            kv_cache_usage=load.token_usage, max_total_tokens=load.max_total_tokens,
            used_tokens=int(load.token_usage * load.max_total_tokens),
            tokens_per_second=self._metrics.tokens_per_second(),
            queue_time_p95_s=load.queue_time_p95 if load.scraped else self._metrics.queue_time_p95(),
            ttft_p95_s=load.ttft_p95 if load.scraped else self._metrics.ttft_p95(),
            itl_mean_s=itl_mean, itl_p95_s=itl_p95,
        )
