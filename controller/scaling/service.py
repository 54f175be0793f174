"""The scaling and autoscaler RPCs of ``ControllerService``: decode -> Scaler / AutoscalerLoop -> encode.

ScaleOut and ScaleIn answer a ``google.longrunning.Operation`` (:mod:`.lro`, which also serves
``google.longrunning.Operations`` to read, wait for, cancel and delete them).

Mutating scale RPCs check the credential first (:mod:`controller.auth`), so a
refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from google.longrunning import operations_pb2
import grpc
from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from mesh_runtime.reasons import Reason
from rollmesh.controller.v1 import autoscaler_pb2, scaling_pb2

from .. import convert
from . import convert as convert_scaling
from . import lro
from ..auth import require_scale_credential
from .autoscaler import Autoscaler
from .autoscaler_loop import MODEL, AutoscalerLoop
from .operations import OperationState

_POLICY_VALUES = set(convert_scaling.POLICY_NAMES) | {scaling_pb2.PARTIAL_SUCCESS_POLICY_UNSPECIFIED}


def _timeout(request: scaling_pb2.ScaleOutRequest | scaling_pb2.ScaleInRequest) -> float | None:
    return convert.seconds(request.timeout) if request.HasField("timeout") else None


def _states(values: Iterable[scaling_pb2.OperationState.ValueType]) -> set[OperationState]:
    try:
        return {convert_scaling.state_from_proto(v) for v in values if v}
    except ValueError:
        raise InvalidArgument(f"unknown operation state in {list(values)}", reason=Reason.INVALID_STATE) from None


class ScalingRpcs:
    """Mixed into ``ControllerServicer``; needs ``self.api`` and ``self.config``."""

    if TYPE_CHECKING:
        from ..api import ControllerApi
        from ..config import ControllerConfig

        config: ControllerConfig

        @property
        def api(self) -> ControllerApi: ...

    async def ScaleOut(self, request: scaling_pb2.ScaleOutRequest,  # noqa: N802 - gRPC method names throughout
                       context: grpc.aio.ServicerContext) -> operations_pb2.Operation:
        require_scale_credential(context, self.config, "ScaleOut")
        if request.partial_success_policy not in _POLICY_VALUES:
            raise InvalidArgument(f"unknown partial_success_policy {request.partial_success_policy}",
                                  reason=Reason.INVALID_POLICY)
        target = request.WhichOneof("target")
        if target is None:
            raise InvalidArgument("give num_replicas (native mode) or external.addresses (external mode)",
                                  reason=Reason.AMBIGUOUS_SCALE_OUT)
        if target == "num_replicas" and request.num_replicas <= 0:
            raise InvalidArgument(f"num_replicas must be at least 1, got {request.num_replicas}",
                                  reason=Reason.INVALID_TARGET)
        op, message = await self.api.scaler.scale_out(
            model_name=request.model_name, num_replicas=request.num_replicas,
            engine_addresses=list(request.external.addresses), timeout_s=_timeout(request),
            request_id=request.request_id, dry_run=request.dry_run,
            policy=convert_scaling.POLICY_NAMES.get(request.partial_success_policy, ""))
        return lro.long_running(op, summary=message)

    async def ScaleIn(self, request: scaling_pb2.ScaleInRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> operations_pb2.Operation:
        require_scale_credential(context, self.config, "ScaleIn")
        target = request.WhichOneof("target")
        if target is None:
            raise InvalidArgument("give num_replicas (target remaining count) or replicas (replica_ids and/or "
                                  "engine_addresses)", reason=Reason.NOTHING_TO_SCALE_IN)
        if target == "num_replicas" and request.num_replicas <= 0:
            raise InvalidArgument(f"num_replicas must be at least 1, got {request.num_replicas}",
                                  reason=Reason.INVALID_TARGET)
        if target == "replicas" and not request.replicas.replica_ids and not request.replicas.engine_addresses:
            raise InvalidArgument("replicas must name at least one replica (replica_ids or engine_addresses)",
                                  reason=Reason.NOTHING_TO_SCALE_IN)
        op, would_remove, message = await self.api.scaler.scale_in(
            model_name=request.model_name, num_replicas=request.num_replicas,
            replica_ids=list(request.replicas.replica_ids), engine_addresses=list(request.replicas.engine_addresses),
            force=request.force, timeout_s=_timeout(request), dry_run=request.dry_run, request_id=request.request_id)
        return lro.long_running(op, summary=message, would_remove=would_remove if request.dry_run else ())

    async def CancelOperations(self, request: scaling_pb2.CancelOperationsRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> scaling_pb2.CancelOperationsResponse:
        require_scale_credential(context, self.config, "CancelOperations")
        ids = await self.api.scaler.cancel_many(_states(request.states), request.dry_run)
        return scaling_pb2.CancelOperationsResponse(cancelled_operation_ids=ids)

    # ------------------------------------------------------------- autoscaler
    def _autoscaler_status(self) -> autoscaler_pb2.AutoscalerStatus:
        loop = self.api.autoscaler
        scaler = self.api.scaler
        msg = autoscaler_pb2.AutoscalerStatus(configured=loop.configured, running=loop.running,
                                              current_engines=len(scaler.pool(MODEL)),
                                              pending_operation_ids=sorted(loop.pending))
        core = loop.core
        if core is None:
            return msg
        msg.enabled, msg.min_engines, msg.max_engines = core.enabled, core.config.min_engines, core.config.max_engines
        if core.last_scale_time and core.last_scale_action is not None:
            msg.last_scale_time.CopyFrom(convert.timestamp(core.last_scale_time))
            msg.last_scale_action = convert_scaling.ACTIONS[core.last_scale_action]
        last = convert_scaling.decision(core.last_decision, loop.decided_at)
        if last is not None:
            msg.last_decision.CopyFrom(last)
        msg.recent_metrics.CopyFrom(convert_scaling.metrics(core.latest, loop.throughput_variance()))
        return msg

    def _configured_autoscaler(self) -> tuple[AutoscalerLoop, Autoscaler]:
        """The autoscaler loop and its decision core; FAILED_PRECONDITION without an autoscaler_config."""
        if self.api.autoscaler.core is None:
            raise FailedPrecondition("the controller was started without autoscaler_config "
                                     "(--autoscaler-config FILE); there is no autoscaler",
                                     reason=Reason.AUTOSCALER_NOT_CONFIGURED)
        return self.api.autoscaler, self.api.autoscaler.core

    async def GetAutoscalerStatus(self, request: autoscaler_pb2.GetAutoscalerStatusRequest,  # noqa: N802
                                  context: grpc.aio.ServicerContext) -> autoscaler_pb2.GetAutoscalerStatusResponse:
        return autoscaler_pb2.GetAutoscalerStatusResponse(status=self._autoscaler_status())

    async def SetAutoscalerEnabled(self, request: autoscaler_pb2.SetAutoscalerEnabledRequest,  # noqa: N802
                                   context: grpc.aio.ServicerContext) -> autoscaler_pb2.SetAutoscalerEnabledResponse:
        require_scale_credential(context, self.config, "SetAutoscalerEnabled")
        self._configured_autoscaler()[0].set_enabled(request.enabled)
        return autoscaler_pb2.SetAutoscalerEnabledResponse(status=self._autoscaler_status())

    async def GetAutoscalerConditions(  # noqa: N802
            self, request: autoscaler_pb2.GetAutoscalerConditionsRequest,
            context: grpc.aio.ServicerContext) -> autoscaler_pb2.GetAutoscalerConditionsResponse:
        loop, core = self._configured_autoscaler()
        now = self.api.clock()
        conditions = core.conditions(now)
        return autoscaler_pb2.GetAutoscalerConditionsResponse(
            conditions=[convert_scaling.condition(c) for c in conditions.values()],
            metrics=convert_scaling.metrics(core.latest, loop.throughput_variance()))

    async def ListScaleHistory(self, request: autoscaler_pb2.ListScaleHistoryRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext) -> autoscaler_pb2.ListScaleHistoryResponse:
        if request.action not in convert_scaling.ACTION_NAMES and request.action:
            raise InvalidArgument(f"unknown action {request.action}", reason=Reason.INVALID_ACTION)
        action = convert_scaling.ACTION_NAMES.get(request.action) if request.action else None
        records, total = self.api.autoscaler.records(action, request.limit or 100)
        return autoscaler_pb2.ListScaleHistoryResponse(
            history=[convert_scaling.history_record(h) for h in records], total_count=total)
