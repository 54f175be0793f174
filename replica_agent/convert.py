"""Conversions between the replica agent's protobuf messages and engine types.

Validation of wire input happens here, before anything reaches an engine:
bad input raises :class:`~mesh_runtime.errors.InvalidArgument` naming the field.
"""

from __future__ import annotations

from typing import Any

from mesh_runtime.durations import set_seconds
from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason
from mesh_runtime.generation import (
    check_duration,
    check_generation,
    check_streaming,
    flush_interval_of,
    temperature_of,
    top_p_of,
)
from rollmesh.common.v1 import generation_pb2, load_pb2, types_pb2
from rollmesh.replica.v1 import replica_agent_pb2

from .engines import EngineRequest, FinishReason, GenerationChunk, LoadSnapshot, SamplingParams, TokenSegment

FINISH_REASONS = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORTED,
}
KINDS = {"STANDALONE": types_pb2.REPLICA_KIND_STANDALONE, "HYBRID": types_pb2.REPLICA_KIND_HYBRID}
KIND_NAMES = {v: k for k, v in KINDS.items()}
BACKENDS = {"torch": types_pb2.ENGINE_BACKEND_TORCH, "vllm": types_pb2.ENGINE_BACKEND_VLLM,
            "synthetic": types_pb2.ENGINE_BACKEND_SYNTHETIC, "sglang": types_pb2.ENGINE_BACKEND_SGLANG}
WAKE_TAGS = {types_pb2.WAKE_TAG_WEIGHTS: "weights", types_pb2.WAKE_TAG_KV_CACHE: "kv_cache"}


def sampling_from_proto(sp: generation_pb2.SamplingParams) -> SamplingParams:
    """The engine's sampling parameters of ``sp`` (checked by :func:`check_generation` first)."""
    return SamplingParams(max_tokens=sp.max_tokens, temperature=temperature_of(sp), top_p=top_p_of(sp),
                          top_k=sp.top_k, seed=sp.seed if sp.HasField("seed") else None,
                          stop_token_ids=list(sp.stop_token_ids), logprobs=sp.logprobs, ignore_eos=sp.ignore_eos)


def segment_from_proto(seg: generation_pb2.TokenSegment) -> TokenSegment:
    return TokenSegment(token_ids=list(seg.token_ids), logprobs=list(seg.logprobs),
                        weight_version=seg.weight_version, replica_id=seg.replica_id, node_id=seg.node_id)


def segment_to_proto(seg: TokenSegment) -> generation_pb2.TokenSegment:
    return generation_pb2.TokenSegment(token_ids=seg.token_ids, logprobs=seg.logprobs,
                                       weight_version=seg.weight_version, replica_id=seg.replica_id,
                                       node_id=seg.node_id)


def generation_request(msg: replica_agent_pb2.GenerateRequest) -> EngineRequest:
    """Decode and validate a Generate request, once: the engine checks only its own limits (``checked``)."""
    check_generation(msg.request_id, msg.prompt_token_ids, msg.sampling_params, msg.resume_segments)
    check_streaming(msg)
    hold_kv_s = check_duration(msg, "hold_kv", Reason.INVALID_KV_HOLD) or 0.0
    return EngineRequest(request_id=msg.request_id, prompt_token_ids=list(msg.prompt_token_ids),
                             sampling=sampling_from_proto(msg.sampling_params),
                             resume_segments=[segment_from_proto(s) for s in msg.resume_segments],
                             stream_interval=msg.stream_interval if msg.HasField("stream_interval") else None,
                             flush_interval_s=flush_interval_of(msg), session_id=msg.session_id,
                             hold_kv_s=hold_kv_s if msg.session_id else 0.0, checked=True)


def chunk_to_proto(chunk: GenerationChunk) -> replica_agent_pb2.GenerateResponse:
    out = replica_agent_pb2.GenerateResponse(request_id=chunk.request_id, token_ids=chunk.token_ids,
                                             logprobs=chunk.logprobs, weight_version=chunk.weight_version)
    if chunk.finish_reason is not None:
        out.finish_reason = FINISH_REASONS[chunk.finish_reason]
        out.segments.extend(segment_to_proto(s) for s in chunk.segments)
        if chunk.usage is not None:
            out.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=chunk.usage.prompt_tokens,
                                                    completion_tokens=chunk.usage.completion_tokens,
                                                    resumed_tokens=chunk.usage.resumed_tokens, attempts=1,
                                                    cached_tokens=chunk.usage.cached_tokens))
    return out


def load_report(snapshot: LoadSnapshot, **identity: Any) -> load_pb2.LoadReport:
    """A LoadReport from an engine snapshot; ``identity`` fills id, state, kind, version."""
    report = load_pb2.LoadReport(
        running_requests=snapshot.running, waiting_requests=snapshot.waiting,
        kv_cache_usage=snapshot.kv_cache_usage, max_total_tokens=snapshot.max_total_tokens,
        used_tokens=snapshot.used_tokens, generation_tokens_per_second=snapshot.tokens_per_second,
        prefix_cache_tokens=snapshot.prefix_cache_tokens, prefix_cache_hit_rate=snapshot.prefix_cache_hit_rate,
        **identity)
    set_seconds(report.queue_time_p95, snapshot.queue_time_p95_s)
    set_seconds(report.time_to_first_token_p95, snapshot.ttft_p95_s)
    set_seconds(report.inter_token_latency_mean, snapshot.itl_mean_s)
    set_seconds(report.inter_token_latency_p95, snapshot.itl_p95_s)
    report.reported_at.GetCurrentTime()
    return report


def state_enum(name: str) -> types_pb2.ReplicaState.ValueType:
    return types_pb2.ReplicaState.Value(f"REPLICA_STATE_{name}")


def state_name(value: types_pb2.ReplicaState.ValueType) -> str:
    return types_pb2.ReplicaState.Name(value).removeprefix("REPLICA_STATE_")
