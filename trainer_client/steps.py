"""The step protocol's client side, written once: the step report built from a trainer's counters, and the
three calls (begin -> release -> complete), each repeated while the controller cannot answer it.

:class:`MeshClient` (custom trainers) and the built-in driver (``trainer_agent.driver.loop``) both call the
controller through :class:`StepProtocol`, so the report a policy reads is built one way whoever trains. The
controller answers a repeated call of the current step with the answer it recorded (stored before it
replied), so a repeat across a controller restart is safe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from mesh_runtime import samples
from mesh_runtime.durations import duration, set_seconds
from mesh_runtime.retry import call_again
from rollmesh.controller.v1 import scheduling_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepProtocolError(RuntimeError):
    """A step-protocol call the controller refused for good, or that found no controller before its deadline."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Counters:
    """What the trainer tells the controller, in samples (one prompt with its ``rollout.n`` responses).

    Set the first three once from the trainer's config; update the others as the trainer runs. The client
    derives the rest of the step report (``expected_samples``, ``buffer_samples``) with verl's formulas.
    """

    required_samples: int
    """Samples one training step consumes: verl's ``ppo_mini_batch_size x require_batches``."""
    trigger_parameter_sync_step: int = 1
    """Training steps between weight syncs."""
    staleness_threshold: float = 0.0
    """verl's ``async_training.staleness_threshold`` (headroom the rollout may run ahead)."""
    generated_samples: int = 0
    """Samples generated so far in the whole run (cumulative; the policies compare it with
    ``required_samples x trigger x global_step``)."""
    queued_samples: int = 0
    """Samples waiting in the trainer's buffer now."""
    consumed_samples: int = 0
    """Samples the last step consumed (informational)."""
    dropped_samples: int = 0
    """Samples the last step dropped as too stale (informational)."""
    step_wait_times_s: list[float] = dataclasses.field(default_factory=list)
    """How long each collection of the last step waited for its samples."""
    step_wait_samples: list[int] = dataclasses.field(default_factory=list)
    """How many samples each of those collections had to wait for."""
    timing_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """verl's ``timing_raw`` of the last step in seconds (``gen``, ``update_actor``, ...)."""
    train_allocated_s: float | None = None
    """Seconds the trainer's GPUs were held for the last step (section 4.1's train utilization); None: not
    measured."""
    train_compute_s: float | None = None
    """Seconds of those the trainer computed; None: not measured."""
    step_generated_samples: int = 0
    """Samples the rollout generated during the last step (section 4.2)."""
    rollout_concurrency: Sequence[tuple[float, int, int]] = ()
    """The rollout's concurrency over the last step: (unix time, active tasks, capacity) points."""

    def report(self, global_step: int) -> scheduling_pb2.StepReport:
        """The step report of ``global_step``, every field the policies and the metrics read."""
        step_required = samples.step_required_samples(self.required_samples, self.trigger_parameter_sync_step)
        report = scheduling_pb2.StepReport(
            required_samples=self.required_samples, trigger_parameter_sync_step=self.trigger_parameter_sync_step,
            total_generated_samples=self.generated_samples,
            expected_samples=samples.expected_samples(step_required, global_step),
            buffer_samples=samples.buffer_samples(step_required, self.staleness_threshold),
            queue_size=self.queued_samples, samples_consumed=self.consumed_samples,
            samples_dropped=self.dropped_samples, step_wait_samples=list(self.step_wait_samples),
            step_generated_samples=self.step_generated_samples)
        for seconds in self.step_wait_times_s:
            report.step_wait_times.append(duration(seconds))
        for key, seconds in self.timing_s.items():
            report.timing_raw[key].CopyFrom(duration(seconds))
        if self.train_allocated_s is not None:
            report.train_allocated_time.CopyFrom(duration(self.train_allocated_s))
        if self.train_compute_s is not None:
            report.train_compute_time.CopyFrom(duration(self.train_compute_s))
        for t, active, capacity in self.rollout_concurrency:
            point = report.rollout_concurrency.add(active_tasks=active, capacity=capacity)
            set_seconds(point.time, t)
        return report


@dataclasses.dataclass(frozen=True)
class BeginResult:
    deactivate: bool
    """Whether hybrid replicas are to be released before this step: wait until the buffer holds
    ``wait_samples`` (at most ``wait_timeout_s``), then call :meth:`StepProtocol.release_hybrids`."""
    wait_samples: int
    wait_timeout_s: float
    response: scheduling_pb2.BeginTrainingStepResponse


@dataclasses.dataclass(frozen=True)
class ReleaseResult:
    released_replica_ids: list[str]
    failed_replica_ids: list[str]
    response: scheduling_pb2.ReleaseHybridReplicasResponse


@dataclasses.dataclass(frozen=True)
class CompleteResult:
    hybrid_activated: bool
    bytes_sent: int
    bytes_saved: int
    failed_replicas: dict[str, str]
    """Replicas whose part of the broadcast failed, with the error (they are synced again or leave routing)."""
    response: scheduling_pb2.CompleteTrainingStepResponse


class StepProtocol:
    """The step protocol on a controller stub (``ControllerServiceStub`` or anything with its three methods).

    A call is repeated while the controller cannot answer it (:func:`mesh_runtime.retry.call_again`: on
    ``UNAVAILABLE``, or when it said when with a ``RetryInfo``) as long as the next try starts within
    ``window_s`` (``sync_window_s`` for ``CompleteTrainingStep``, which waits for the weight broadcast). Each
    try's deadline is ``try_timeout_s`` (``sync_try_timeout_s``), or what remains of the window when None.
    A call that fails for good raises :class:`StepProtocolError`."""

    def __init__(self, stub: Any, *, window_s: float, sync_window_s: float, try_timeout_s: float | None = None,
                 sync_try_timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._stub = stub
        self._window_s = window_s
        self._sync_window_s = sync_window_s
        self._try_timeout_s = try_timeout_s
        self._sync_try_timeout_s = sync_try_timeout_s
        self._metadata = {"metadata": tuple(metadata)} if metadata else {}

    async def _call(self, what: str, method: Callable[..., Awaitable[T]], request: Any, *, sync: bool = False) -> T:
        def told(err: grpc.RpcError, wait: float) -> None:
            details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
            log.warning("step protocol: %s: the controller cannot answer (%s); trying again in %.2f s",
                        what, details, wait)

        try:
            return await call_again(lambda timeout: method(request, timeout=timeout, **self._metadata),
                                    within_s=self._sync_window_s if sync else self._window_s,
                                    timeout_s=self._sync_try_timeout_s if sync else self._try_timeout_s,
                                    on_retry=told)
        except grpc.aio.AioRpcError as err:
            raise StepProtocolError(f"{what} failed: {err.code().name}: {err.details()}", err.code()) from err

    async def begin_step(self, global_step: int, counters: Counters) -> BeginResult:
        """Start training step ``global_step``: whether to release the hybrid replicas first, and after how
        many buffered samples."""
        request = scheduling_pb2.BeginTrainingStepRequest(global_step=global_step, report=counters.report(global_step))
        reply = await self._call(f"BeginTrainingStep({global_step})", self._stub.BeginTrainingStep, request)
        return BeginResult(reply.deactivate, reply.wait_samples, reply.wait_timeout.ToTimedelta().total_seconds(),
                           reply)

    async def release_hybrids(self, global_step: int, *, buffered_samples: int, waited_s: float,
                              wait_expired: bool) -> ReleaseResult:
        """Release the hybrid replicas: out of routing, their requests aborted, asleep."""
        request = scheduling_pb2.ReleaseHybridReplicasRequest(
            global_step=global_step, buffered_samples=buffered_samples, waited=duration(waited_s),
            wait_expired=wait_expired)
        reply = await self._call(f"ReleaseHybridReplicas({global_step})", self._stub.ReleaseHybridReplicas, request)
        return ReleaseResult(list(reply.released_replica_ids), list(reply.failed_replica_ids), reply)

    async def complete_step(self, global_step: int, weight_version: int, counters: Counters) -> CompleteResult:
        """End the step: the controller broadcasts ``weight_version`` and may activate the hybrid replicas."""
        request = scheduling_pb2.CompleteTrainingStepRequest(global_step=global_step, weight_version=weight_version,
                                                             report=counters.report(global_step))
        reply = await self._call(f"CompleteTrainingStep({global_step})", self._stub.CompleteTrainingStep, request,
                                 sync=True)
        failed = {r.replica_id: r.error_message for sync in (reply.standalone_sync, reply.hybrid_sync)
                  for r in sync.replica_results if not r.ok}
        return CompleteResult(reply.hybrid_activated, reply.bytes_sent, reply.bytes_saved, failed, reply)
