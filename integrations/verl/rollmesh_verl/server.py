"""The server behind one verl rollout replica: verl's token-in-token-out calls, served by the rollmesh fleet.

verl's clients (``LLMServerClient``, ``FullyAsyncLLMServerClient``) call ``generate`` on a replica's server handle,
a Ray actor; :class:`RollmeshServer` is that actor. Each call is one generation through rollmesh's load balancer
(its routing, retries and resumes: a replica that dies mid-generation costs the caller nothing), streamed in chunks
of ``stream_interval`` tokens so that an abort can hand back what was generated.

verl's abort contract, as its vLLM server keeps it: ``abort_all_requests`` closes an admission gate and ends every
generation in flight with ``stop_reason="aborted"`` and the tokens streamed so far (verl's fully-async client sends
prompt + those tokens again once generation resumes); requests that arrive while the gate is closed wait for
``resume_generation``, or, after ``abort_all_requests(reject_request=True)``, come back aborted at once with no
tokens. Results carry the log-probabilities and, in ``extra_fields``, the weight version of every token
(``weight_versions``), ``global_steps`` (the oldest of them, so verl's staleness never undercounts),
``min_global_steps`` / ``max_global_steps`` and ``num_cached_tokens``.

The actor is also the replica's one rollout worker for verl's ``CheckpointEngineManager``
(``execute_checkpoint_engine``, ``update_weights``), with the ``rollmesh`` checkpoint engine (:mod:`.weights`).

Sleep and wake of rollmesh replicas belong to rollmesh's controller (its dynamic scheduling decides them), so
``sleep`` / ``wake_up`` from verl are refused with an error that says so; ``release_kv_cache`` /
``resume_kv_cache`` / ``clear_kv_cache`` need no work here, because rollmesh's weight sync receives into the
replicas' own weight buffers and retires their prefix caches itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from mesh_runtime.generate_many import BalancerGenerations
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2

from .sampling import sampling_params as to_sampling
from .settings import MeshSettings, mesh_settings

log = logging.getLogger(__name__)

_DONE = {generation_pb2.FINISH_REASON_STOP: "completed", generation_pb2.FINISH_REASON_LENGTH: "completed",
         generation_pb2.FINISH_REASON_ABORTED: "aborted"}


class ControlledByRollmesh(RuntimeError):
    """verl asked for a transition that rollmesh's controller owns."""


@dataclass
class _InFlight:
    """One generation in flight: what it streamed so far, and how to end it."""

    request_id: str
    call: Any
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    aborted: bool = False


class RollmeshServer:
    """verl's server handle of one rollout replica (a Ray actor); see the module docstring."""

    def __init__(self, engine_kwargs: dict[str, Any], *, replica_rank: int, response_length: int,
                 prompt_length: int) -> None:
        self.settings: MeshSettings = mesh_settings(engine_kwargs)
        self._engine_kwargs = dict(engine_kwargs)
        self._engine: Any = None
        self.replica_rank = replica_rank
        self.response_length = response_length
        self.prompt_length = prompt_length
        self.global_steps: int | None = None   # the newest weight version a result carried
        self._generations: BalancerGenerations | None = None
        self._client: Any = None
        self._open = asyncio.Event()
        self._open.set()
        self._rejecting = False
        self._in_flight: dict[int, _InFlight] = {}
        self._ids = itertools.count()

    async def _balancers(self) -> BalancerGenerations:
        if self._generations is None:
            from trainer_client import MeshClient  # noqa: PLC0415

            self._client = MeshClient(self.settings.controller, tls=self.settings.tls,
                                      call_timeout_s=self.settings.call_timeout_s)
            channel = await self._client.generation_channel(self.settings.load_balancer,
                                                           timeout_s=self.settings.call_timeout_s)
            self._generations = BalancerGenerations(channel)
        return self._generations

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> Any:
        """One generation (verl's server ``generate``): a ``TokenOutput``."""
        from verl.workers.rollout.replica import TokenOutput  # noqa: PLC0415

        if image_data is not None or video_data is not None or audio_data is not None or mm_processor_kwargs:
            raise ValueError("rollmesh serves text models: image, video and audio inputs are not supported")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        default = max(1, min(self.response_length, self.prompt_length + self.response_length - len(prompt)))
        params = to_sampling(sampling_params, default_max_tokens=default)
        while not self._open.is_set():
            if self._rejecting:
                return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                                   extra_fields={"global_steps": self.global_steps})
            await self._open.wait()
        generations = await self._balancers()
        request = loadbalancer_pb2.GenerateRequest(
            request_id=str(request_id), prompt_token_ids=prompt, sampling_params=params, partial_rollout=True,
            stream_interval=self.settings.stream_interval)
        key = next(self._ids)
        flight = self._in_flight[key] = _InFlight(str(request_id), generations.call(
            request, timeout_s=self.settings.generate_timeout_s))
        try:
            final = None
            try:
                async for message in flight.call:
                    flight.tokens.extend(message.token_ids)
                    flight.logprobs.extend(message.logprobs)
                    flight.versions.extend([int(message.weight_version)] * len(message.token_ids))
                    if message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                        final = message
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not flight.aborted or (task is not None and task.cancelling()):
                    raise   # our caller cancelled us, not an abort of ours
            except grpc.aio.AioRpcError as err:
                if not flight.aborted:
                    raise RuntimeError(f"rollmesh: generation {str(request_id)[:64]!r} failed: "
                                       f"{err.code().name}: {err.details()}") from None
            if final is None:   # ended by an abort of ours (one that came after the result changes nothing)
                if not flight.aborted:
                    raise RuntimeError(f"rollmesh: generation {str(request_id)[:64]!r} ended without a result")
                return self._output(flight.tokens, flight.logprobs, flight.versions, "aborted",
                                    params.logprobs, cached=None)
            tokens, logprobs, versions = [], [], []
            for segment in final.segments:   # the authoritative result: every attempt's tokens, in order
                tokens.extend(segment.token_ids)
                logprobs.extend(segment.logprobs)
                versions.extend([int(segment.weight_version)] * len(segment.token_ids))
            return self._output(tokens, logprobs, versions, _DONE[final.finish_reason], params.logprobs,
                                cached=int(final.usage.cached_tokens))
        finally:
            del self._in_flight[key]

    def _output(self, tokens: list[int], logprobs: list[float], versions: list[int], stop_reason: str,
                with_logprobs: bool, *, cached: int | None) -> Any:
        from verl.workers.rollout.replica import TokenOutput  # noqa: PLC0415

        if versions:
            self.global_steps = max(self.global_steps or 0, max(versions))
        extra: dict[str, Any] = {
            "global_steps": min(versions) if versions else self.global_steps,
            "min_global_steps": min(versions) if versions else self.global_steps,
            "max_global_steps": max(versions) if versions else self.global_steps,
            "weight_versions": versions,
            "num_cached_tokens": cached,
        }
        return TokenOutput(token_ids=tokens, log_probs=logprobs if with_logprobs else None, stop_reason=stop_reason,
                           extra_fields=extra)

    # -- verl's lifecycle calls ------------------------------------------------------------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate, end every generation in flight as aborted with what it streamed (see the module)."""
        self._rejecting = reject_request
        self._open.clear()
        aborted = list(self._in_flight.values())
        for flight in aborted:
            flight.aborted = True
            flight.call.cancel()
        return {"aborted_count": len(aborted), "request_ids": [f.request_id for f in aborted]}

    async def resume_generation(self) -> None:
        """Open the gate: parked requests go on, new ones are admitted."""
        self._rejecting = False
        self._open.set()

    async def release_kv_cache(self) -> None:
        """Nothing to free: rollmesh's weight sync writes into the replicas' weight buffers in place."""

    async def resume_kv_cache(self) -> None:
        """Nothing to restore (see :meth:`release_kv_cache`)."""

    async def clear_kv_cache(self) -> None:
        """Nothing to clear: a rollmesh replica retires its prefix cache when its weights change, and a cached
        prefix is reused only under the weights that computed it."""

    async def sleep(self) -> None:
        raise ControlledByRollmesh("rollmesh replicas sleep and wake under rollmesh's controller (its dynamic "
                                   "scheduling), not at verl's request: verl's hybrid replicas on the trainer's "
                                   "GPUs are not served by the rollmesh backend")

    async def wake_up(self) -> None:
        await self.sleep()

    async def start_profile(self, **kwargs: Any) -> None:
        raise ControlledByRollmesh("rollmesh engines are not profiled through verl: use rollmesh's OpenTelemetry "
                                   "traces and Prometheus metrics")

    async def stop_profile(self) -> None:
        await self.start_profile()

    # -- verl's checkpoint-engine calls (this actor is also the replica's one rollout worker) -------------

    def _checkpoint_engine(self) -> Any:
        if self._engine is None:
            from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: PLC0415

            from . import weights  # noqa: F401, PLC0415 - registers the backend in this process

            self._engine = CheckpointEngineRegistry.new("rollmesh", bucket_size=0, **self._engine_kwargs)
        return self._engine

    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """verl's ``CheckpointEngineManager`` calling the rollout side's engine (``prepare``, ``finalize``...)."""
        return getattr(self._checkpoint_engine(), method)(*args, **kwargs)

    async def update_weights(self, global_steps: int | None = None) -> None:
        """The rollout side of verl's update: rollmesh's broadcast delivers the weights (nothing through verl)."""
        async for _ in self._checkpoint_engine().receive_weights(global_steps=global_steps):
            raise RuntimeError("the rollmesh backend delivers no weights through verl")

    async def ping(self) -> int:
        """The replica's rank (a liveness check used at start)."""
        return self.replica_rank

    async def status(self) -> dict[str, Any]:
        """What the server holds now: the tokens each generation in flight streamed so far, whether the gate is
        open, and the newest weight version a result carried."""
        return {"streamed": [len(f.tokens) for f in self._in_flight.values()], "open": self._open.is_set(),
                "rejecting": self._rejecting, "global_steps": self.global_steps}
