"""Conversions between scale operations / autoscaler state and the wire messages. No side effects."""

from __future__ import annotations

from rollmesh.controller.state.v1 import documents_pb2 as state_pb2
from rollmesh.controller.v1 import autoscaler_pb2, scaling_pb2

from ..convert import duration, timestamp
from .autoscaler import SCALE_IN, SCALE_OUT, ConditionStatus, Decision, MetricsSample
from .operations import OperationState, OperationType, ScaleOperation

POLICY_NAMES = {scaling_pb2.PARTIAL_SUCCESS_POLICY_ROLLBACK_ALL: "rollback_all",
                scaling_pb2.PARTIAL_SUCCESS_POLICY_KEEP_PARTIAL: "keep_partial"}
POLICY_VALUES = {v: k for k, v in POLICY_NAMES.items()}
_NO_POLICY = scaling_pb2.PARTIAL_SUCCESS_POLICY_UNSPECIFIED
ACTIONS = {SCALE_OUT: autoscaler_pb2.SCALE_ACTION_SCALE_OUT, SCALE_IN: autoscaler_pb2.SCALE_ACTION_SCALE_IN,
           "none": autoscaler_pb2.SCALE_ACTION_NONE}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


def state_from_proto(value: scaling_pb2.OperationState.ValueType) -> OperationState:
    return OperationState(scaling_pb2.OperationState.Name(value).removeprefix("OPERATION_STATE_"))


def type_from_proto(value: scaling_pb2.OperationType.ValueType) -> OperationType:
    return OperationType(scaling_pb2.OperationType.Name(value).removeprefix("OPERATION_TYPE_"))


def operation(op: ScaleOperation) -> scaling_pb2.ScaleOperation:
    msg = scaling_pb2.ScaleOperation(
        operation_id=op.operation_id, type=scaling_pb2.OperationType.Value(op.type.proto_name),
        state=scaling_pb2.OperationState.Value(op.state.proto_name), model_name=op.model_name,
        num_replicas=op.num_replicas, engine_addresses=op.engine_addresses, replica_ids=op.replica_ids,
        failed_replica_ids=op.failed_replica_ids, created_at=timestamp(op.created_at),
        updated_at=timestamp(op.updated_at), error_message=op.error_message, force=op.force, dry_run=op.dry_run,
        timeout=duration(op.timeout_s), triggered_by=op.triggered_by, request_id=op.request_id,
        partial_success_policy=POLICY_VALUES.get(op.partial_success_policy, _NO_POLICY)
        if op.type is OperationType.SCALE_OUT else _NO_POLICY,
        state_history=[scaling_pb2.OperationStateChange(
            state=scaling_pb2.OperationState.Value(c.state.proto_name), at=timestamp(c.at), reason=c.reason)
            for c in op.state_history])
    if op.weight_version is not None:
        msg.weight_version = op.weight_version
    return msg


def metrics(sample: MetricsSample | None, variance: float) -> autoscaler_pb2.AutoscalerMetrics:
    if sample is None:
        return autoscaler_pb2.AutoscalerMetrics()
    return autoscaler_pb2.AutoscalerMetrics(
        num_engines=sample.num_engines, avg_token_usage=sample.avg_token_usage,
        total_queue_reqs=sample.total_queue_reqs, queue_time_p95=duration(sample.queue_time_p95),
        ttft_p95=duration(sample.ttft_p95), throughput=sample.throughput, throughput_variance=variance,
        collected_at=timestamp(sample.time))


def decision(d: Decision | None, at: float | None) -> autoscaler_pb2.AutoscalerDecision | None:
    if d is None:
        return None
    return autoscaler_pb2.AutoscalerDecision(action=ACTIONS[d.action], reason=d.reason,
                                             delta=d.delta if d.action != SCALE_IN else -d.delta,
                                             decided_at=timestamp(at), triggered_conditions=d.triggered_conditions)


def condition(c: ConditionStatus) -> autoscaler_pb2.AutoscalerCondition:
    value = c.value if c.value is not None and c.value != float("inf") else 0.0
    return autoscaler_pb2.AutoscalerCondition(name=c.name, type=ACTIONS[c.type], triggered=c.triggered,
                                              held_for=duration(c.held_for), required_for=duration(c.required_for),
                                              value=value, threshold=c.threshold)


def history_record(h: state_pb2.AutoscalerAction) -> autoscaler_pb2.ScaleHistoryRecord:
    msg = autoscaler_pb2.ScaleHistoryRecord(
        operation_id=h.operation_id, action=ACTIONS[h.action],
        state=scaling_pb2.OperationState.Value(f"OPERATION_STATE_{h.state}"),
        triggered_at=timestamp(h.triggered_at), from_engines=h.from_engines, to_engines=h.to_engines,
        delta=h.delta, reason=h.reason, triggered_conditions=h.triggered_conditions,
        metrics_snapshot=h.metrics_snapshot, error_message=h.error_message)
    if h.completed_at:   # unset (0) while the operation runs
        msg.completed_at.CopyFrom(timestamp(h.completed_at))
    return msg
