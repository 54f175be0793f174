"""Conversions between the controller core's types and the wire messages.

The core keeps seconds as floats and enums as Python enums; the wire uses
``Duration``/``Timestamp`` and proto enums. Nothing here has side effects.
"""

from __future__ import annotations


from google.protobuf import struct_pb2

from mesh_runtime.durations import duration, timestamp
from mesh_runtime.durations import to_seconds as seconds
from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason
from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import (
    events_pb2,
    observability_pb2,
    registry_pb2,
    scaling_pb2,
    scheduling_pb2,
    weight_sync_pb2,
)

from .core.events import EventType, LifecycleEvent
from .core.hybrid import SchedulerState
from .core.metrics import ClosedCycle, ConcurrencyPoint
from .core.ports import WeightSyncOutcome
from .core.records import NodeRecord, ReplicaKind, ReplicaRecord, ReplicaSpec, ReplicaState
from .core.steps import BeginDecision, CompleteResult, HybridState, ReleaseResult, StepCall, StepReport


def kind_to_proto(kind: ReplicaKind | str) -> types_pb2.ReplicaKind.ValueType:
    name = kind.value if isinstance(kind, ReplicaKind) else kind
    return types_pb2.ReplicaKind.Value(name if name.startswith("REPLICA_KIND_") else f"REPLICA_KIND_{name}")


def kind_from_proto(value: types_pb2.ReplicaKind.ValueType) -> ReplicaKind:
    """The replica kind of a request; INVALID_ARGUMENT for an unset or unknown one."""
    try:
        return ReplicaKind(types_pb2.ReplicaKind.Name(value).removeprefix("REPLICA_KIND_"))
    except ValueError:
        raise InvalidArgument(f"replica kind must be REPLICA_KIND_STANDALONE or REPLICA_KIND_HYBRID, got "
                              f"{value} ({'unset' if value == 0 else 'unknown'})", reason=Reason.INVALID_KIND) from None


def state_to_proto(state: ReplicaState) -> types_pb2.ReplicaState.ValueType:
    return types_pb2.ReplicaState.Value(f"REPLICA_STATE_{state.value}")


def state_from_proto(value: types_pb2.ReplicaState.ValueType) -> ReplicaState:
    """The replica state of a request; INVALID_ARGUMENT for an unset or unknown one."""
    try:
        return ReplicaState(types_pb2.ReplicaState.Name(value).removeprefix("REPLICA_STATE_"))
    except ValueError:
        raise InvalidArgument(f"replica state {value} is {'unset' if value == 0 else 'unknown'}",
                              reason=Reason.INVALID_STATE) from None


def replica_specs(msg: registry_pb2.RegisterNodeRequest) -> list[ReplicaSpec]:
    return [ReplicaSpec(replica_id=r.replica_id, kind=kind_from_proto(r.kind), state=state_from_proto(r.state)
                        if r.state else ReplicaState.LAUNCHING, weight_version=r.weight_version,
                        slots=tuple(r.slots), memory_fraction=r.memory_fraction, initial=r.initial,
                        engine_url=r.engine_url, data_address=r.data_address)
            for r in msg.replicas]


def replica_record(record: ReplicaRecord) -> registry_pb2.ReplicaRecord:
    msg = registry_pb2.ReplicaRecord(
        replica_id=record.replica_id, node_id=record.node_id, address=record.address,
        kind=kind_to_proto(record.kind), state=state_to_proto(record.state), weight_version=record.weight_version,
        initial=record.initial, added_by_operation_id=record.added_by_operation_id,
        intentionally_removed=record.intentionally_removed, state_reason=record.state_reason,
        updated_at=timestamp(record.updated_at), model_name=record.model_name, slots=list(record.slots),
        memory_fraction=record.memory_fraction, engine_url=record.engine_url, data_address=record.data_address)
    if record.lease_expires_at:
        msg.lease_expires_at.CopyFrom(timestamp(record.lease_expires_at))
    if record.last_report is not None:
        msg.last_report.CopyFrom(record.last_report)
    return msg


def node_record(node: NodeRecord, replica_ids: list[str]) -> registry_pb2.NodeRecord:
    msg = registry_pb2.NodeRecord(
        node_id=node.node_id, address=node.address, slots_total=node.slots_total, model=node.model,
        model_name=node.model_name, agent_version=node.agent_version, registered_at=timestamp(node.registered_at),
        lease_expires_at=timestamp(node.lease_expires_at), lease_held=node.lease_held, replica_ids=replica_ids)
    if node.backend:
        msg.backend = types_pb2.EngineBackend.Value(node.backend)
    if node.last_report_at:
        msg.last_report_at.CopyFrom(timestamp(node.last_report_at))
    return msg


def step_report(msg: scheduling_pb2.StepReport) -> StepReport:
    compute = seconds(msg.train_compute_time) if msg.HasField("train_compute_time") else None
    return StepReport(
        required_samples=msg.required_samples, trigger_parameter_sync_step=msg.trigger_parameter_sync_step,
        total_generated_samples=msg.total_generated_samples, expected_samples=msg.expected_samples,
        buffer_samples=msg.buffer_samples, step_wait_times=[seconds(d) for d in msg.step_wait_times],
        step_wait_samples=list(msg.step_wait_samples), queue_size=msg.queue_size,
        timing_raw={k: seconds(v) for k, v in msg.timing_raw.items()}, train_compute_time_s=compute,
        train_allocated_time_s=seconds(msg.train_allocated_time), step_generated_samples=msg.step_generated_samples,
        rollout_concurrency=[ConcurrencyPoint(t=seconds(p.time), active_tasks=p.active_tasks,
                                              capacity=p.capacity) for p in msg.rollout_concurrency],
        samples_consumed=msg.samples_consumed, samples_dropped=msg.samples_dropped)


def _hybrid(state: HybridState) -> scheduling_pb2.HybridState.ValueType:
    return scheduling_pb2.HybridState.Value(state.proto_name)


def _call(call: StepCall) -> scheduling_pb2.StepCall.ValueType:
    return scheduling_pb2.StepCall.Value(call.proto_name)


def begin_response(d: BeginDecision) -> scheduling_pb2.BeginTrainingStepResponse:
    return scheduling_pb2.BeginTrainingStepResponse(
        deactivate=d.deactivate, wait_samples=d.wait_samples, wait_timeout=duration(d.wait_timeout_s),
        hybrid_state=_hybrid(d.hybrid_state), next_call=_call(d.next_call))


def release_response(r: ReleaseResult) -> scheduling_pb2.ReleaseHybridReplicasResponse:
    return scheduling_pb2.ReleaseHybridReplicasResponse(
        released_replica_ids=r.released_replica_ids, failed_replica_ids=r.failed_replica_ids,
        duration=duration(r.duration_s), aborted_requests=r.aborted_requests, hybrid_state=_hybrid(r.hybrid_state),
        next_call=_call(r.next_call))


def sync_result(o: WeightSyncOutcome | None) -> weight_sync_pb2.WeightSyncResult | None:
    if o is None:
        return None
    return weight_sync_pb2.WeightSyncResult(
        sync_id=o.sync_id, weight_version=o.weight_version, bytes_sent=o.bytes_sent,
        skipped_replica_ids=o.skipped_replica_ids, bytes_saved=o.bytes_saved, duration=duration(o.duration_s),
        source=o.source, delta_base_version=o.delta_base_version, delta_bytes=o.delta_bytes,
        full_bytes=o.full_bytes, delta_density=o.delta_density,
        replica_results=[weight_sync_pb2.ReplicaSyncResult(
            replica_id=r.replica_id, ok=r.ok, error_message=r.error_message, duration=duration(r.duration_s),
            bytes_received=r.bytes_received, copy=r.copy, source=r.source) for r in o.replica_results])


def complete_response(c: CompleteResult) -> scheduling_pb2.CompleteTrainingStepResponse:
    msg = scheduling_pb2.CompleteTrainingStepResponse(
        hybrid_activated=c.hybrid_activated, hybrid_sync_skipped=c.hybrid_sync_skipped, bytes_sent=c.bytes_sent,
        bytes_saved=c.bytes_saved, rebalanced=c.rebalanced, rebalanced_requests=c.rebalanced_requests,
        deactivate_ratio=c.deactivate_ratio or 0.0,
        hybrid_state=_hybrid(c.hybrid_state), next_call=_call(c.next_call))
    for name in ("standalone_sync", "hybrid_sync"):
        result = sync_result(getattr(c, name))
        if result is not None:
            getattr(msg, name).CopyFrom(result)
    if c.activation_duration_s is not None:
        msg.activation_duration.CopyFrom(duration(c.activation_duration_s))
    return msg


def scheduler_state(s: SchedulerState) -> scheduling_pb2.GetSchedulerStateResponse:
    params = struct_pb2.Struct()
    params.update({k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in s.policy_parameters.items()})
    msg = scheduling_pb2.GetSchedulerStateResponse(
        enabled=s.enabled, hybrid_state=_hybrid(s.hybrid_state), policy_name=s.policy_name, policy_parameters=params,
        deactivate_ratio=s.deactivate_ratio or 0.0, switch_cost=duration(s.switch_cost_s),
        per_sample_time=duration(s.per_sample_time_s), next_call=_call(s.next_call), activations=s.activations,
        deactivations=s.deactivations, only_hybrid=s.only_hybrid, enable_rebalance=s.enable_rebalance,
        last_activate_duration=duration(s.last_activate_duration_s),
        last_deactivate_duration=duration(s.last_deactivate_duration_s), hybrid_replica_ids=s.hybrid_replica_ids)
    if s.last_global_step is not None:
        msg.last_global_step = s.last_global_step
    return msg


_TYPED_STATES = {EventType.REPLICA_STATE_CHANGED: (types_pb2.ReplicaState, "replica"),
                 EventType.OPERATION_STATE_CHANGED: (scaling_pb2.OperationState, "operation"),
                 EventType.CONTROLLER_STATE_CHANGED: (scheduling_pb2.HybridState, "hybrid")}


def event(e: LifecycleEvent) -> events_pb2.LifecycleEvent:
    msg = events_pb2.LifecycleEvent(
        sequence=e.sequence, time=timestamp(e.time), type=events_pb2.EventType.Value(e.type.proto_name),
        replica_id=e.replica_id, node_id=e.node_id, from_state=e.from_state, to_state=e.to_state, reason=e.reason,
        trace_id=e.trace_id, span_id=e.span_id, operation_id=e.operation_id,
        attributes={k: str(v) for k, v in e.attributes.items()}, missed_events=e.missed_events)
    msg.details.update(dict(e.details))
    typed = _TYPED_STATES.get(e.type)
    if typed is not None:   # the transition's states as their enum too
        enum, prefix = typed
        states = enum.DESCRIPTOR.values_by_name
        for name, field in ((e.from_state, f"from_{prefix}_state"), (e.to_state, f"to_{prefix}_state")):
            if name in states:
                setattr(msg, field, states[name].number)
    if e.replica_kind:
        msg.replica_kind = types_pb2.ReplicaKind.Value(e.replica_kind)
    if e.global_step is not None:
        msg.global_step = e.global_step
    if e.weight_version is not None:
        msg.weight_version = e.weight_version
    return msg


def metrics_cycle(c: ClosedCycle) -> observability_pb2.MetricsCycle:
    return observability_pb2.MetricsCycle(cycle=c.cycle, global_step=c.global_step, weight_version=c.weight_version,
                                          started_at=timestamp(c.started_at), ended_at=timestamp(c.ended_at),
                                          values=c.values)

