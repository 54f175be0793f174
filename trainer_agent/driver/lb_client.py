"""``generate`` callable for the Rollouter backed by a LoadBalancerService stub.

Calls ``rollmesh.loadbalancer.v1.LoadBalancerService/Generate`` (a server
stream, asked for its final message only) and turns that message -- whose ``segments`` are the
authoritative output -- into a :class:`GenerationResult`. gRPC errors
propagate unchanged (the Rollouter retries and then fails); a stream that
ends without a final message, or ends ABORTED, raises ``GenerationError``.
"""

from __future__ import annotations

from typing import Any

from mesh_runtime.generate_many import BalancerGenerations
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from trainer_agent.driver.rollouter import GenerationError, RolloutRequest, GenerationResult, Segment

_FINISH = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORTED: "aborted",
}


def to_proto(request: RolloutRequest) -> loadbalancer_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(max_tokens=request.max_tokens, logprobs=request.logprobs,
                                             stop_token_ids=request.stop_token_ids)
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    msg = loadbalancer_pb2.GenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling,
        session_id=request.session_id,
        partial_rollout=request.partial_rollout,
        final_only=True,   # the driver uses the result only: no token chunks on the wire
    )
    if request.retry_budget is not None:
        msg.retry_budget = request.retry_budget
    if request.min_weight_version is not None:
        msg.min_weight_version = request.min_weight_version
    return msg


class LoadBalancerGenerate:
    """``await LoadBalancerGenerate(stub)(request)`` -> GenerationResult."""

    def __init__(self, stub: Any, *, timeout_s: float | None = None, metadata: Any = None,
                 generations: BalancerGenerations | None = None) -> None:
        """``generations``: send the requests on the balancers' GenerateMany streams (``stub`` is then unused)."""
        self._stub = stub
        self._timeout_s = timeout_s
        self._metadata = metadata
        self._generations = generations

    async def __call__(self, request: RolloutRequest) -> GenerationResult:
        if self._generations is not None:
            call = self._generations.call(to_proto(request), timeout_s=self._timeout_s)
        else:
            kwargs: dict[str, Any] = {}
            if self._timeout_s is not None:
                kwargs["timeout"] = self._timeout_s
            if self._metadata is not None:
                kwargs["metadata"] = self._metadata
            call = self._stub.Generate(to_proto(request), **kwargs)
        final = None
        async for message in call:
            if message.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                final = message
        if final is None:
            raise GenerationError(f"Generate stream for {request.request_id} ended without a final message")
        segments = [
            Segment(
                token_ids=list(seg.token_ids),
                logprobs=list(seg.logprobs),
                weight_version=int(seg.weight_version),
                replica_id=seg.replica_id,
            )
            for seg in final.segments
        ]
        reason = _FINISH.get(final.finish_reason, "aborted")
        if reason == "aborted":
            raise GenerationError(f"Generate for {request.request_id} ended ABORTED")
        return GenerationResult(segments=segments, finish_reason=reason)
