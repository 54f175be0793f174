"""Durable before acknowledged: a controller killed right after a step-protocol reply continues from that reply.

Regression test of the convergence issue's defect 4: the controller answered BeginTrainingStep(3)
and a SIGKILL milliseconds later lost it (state was flushed ~100 ms after the reply), so the
restarted controller expected BeginTrainingStep again and Release/Complete failed. Also the
driver's side: step calls are retried on UNAVAILABLE and the repeated call gets the recorded answer.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from rollmesh.controller.v1 import controller_pb2_grpc, scheduling_pb2
from tests.processes import running_server
from trainer_client import Counters, StepProtocol, StepProtocolError

pytestmark = pytest.mark.timeout(180)


def _report() -> scheduling_pb2.StepReport:
    return scheduling_pb2.StepReport(required_samples=8, trigger_parameter_sync_step=1, expected_samples=8,
                                     buffer_samples=0.8, total_generated_samples=8)


async def test_a_kill_right_after_each_reply_loses_nothing(tmp_path):
    config = tmp_path / "controller.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\nasync_training:\n  use_dynamic_resource_scheduling: true\n")
    args = ["--config", str(config), "--listen", "127.0.0.1:0"]
    log = tmp_path / "controller.log"

    async def call_then_kill(method_name: str, request):
        with running_server("controller", args, log_path=log) as (address, proc):
            async with grpc.aio.insecure_channel(address) as channel:
                reply = await getattr(controller_pb2_grpc.ControllerServiceStub(channel), method_name)(
                    request, timeout=20)
            proc.send_signal(signal.SIGKILL)          # no goodbye, no shutdown flush
            proc.wait(timeout=10)
        return reply

    begin = await call_then_kill("BeginTrainingStep", scheduling_pb2.BeginTrainingStepRequest(
        global_step=1, report=_report()))
    assert begin.next_call == scheduling_pb2.STEP_CALL_COMPLETE_TRAINING_STEP
    # the restarted controller knows step 1 began: the repeat gets the recorded answer, Complete is in order
    again = await call_then_kill("BeginTrainingStep", scheduling_pb2.BeginTrainingStepRequest(
        global_step=1, report=_report()))
    assert again == begin
    done = await call_then_kill("CompleteTrainingStep", scheduling_pb2.CompleteTrainingStepRequest(
        global_step=1, weight_version=1, report=_report()))
    assert done.next_call == scheduling_pb2.STEP_CALL_BEGIN_TRAINING_STEP
    repeat = await call_then_kill("CompleteTrainingStep", scheduling_pb2.CompleteTrainingStepRequest(
        global_step=1, weight_version=1, report=_report()))
    assert repeat == done
    step2 = await call_then_kill("BeginTrainingStep", scheduling_pb2.BeginTrainingStepRequest(
        global_step=2, report=_report()))
    assert step2.next_call == scheduling_pb2.STEP_CALL_COMPLETE_TRAINING_STEP


def _unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="connection refused")


class _Controller:
    """A controller stub whose BeginTrainingStep answers with ``behaviour(request, timeout)``."""

    def __init__(self, behaviour) -> None:
        self.BeginTrainingStep = behaviour


def _steps(behaviour, window_s: float) -> StepProtocol:
    return StepProtocol(_Controller(behaviour), window_s=window_s, sync_window_s=window_s)


async def test_step_calls_ride_out_a_restarting_controller():
    attempts = []

    async def flaky(request, timeout):
        attempts.append((request, timeout))
        if len(attempts) < 3:
            raise _unavailable()
        return scheduling_pb2.BeginTrainingStepResponse(deactivate=True, wait_samples=6)

    counters = Counters(required_samples=8, trigger_parameter_sync_step=2, staleness_threshold=0.5,
                        generated_samples=20, queued_samples=3)
    begin = await _steps(flaky, 10).begin_step(2, counters)
    assert begin.deactivate and begin.wait_samples == 6
    assert len(attempts) == 3 and all(0 < t <= 10 for _, t in attempts)
    assert all(r == attempts[0][0] for r, _ in attempts)      # the same request each time
    report = attempts[0][0].report   # verl's formulas: expected = 8 x 2 x 2, buffer = 16 x 0.5
    assert (report.expected_samples, report.buffer_samples, report.total_generated_samples, report.queue_size) == \
        (32, 8.0, 20, 3)


async def test_step_calls_give_up_at_the_deadline_and_never_retry_other_errors():
    async def down(request, timeout):
        raise _unavailable()

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(StepProtocolError) as info:
        await _steps(down, 0.5).begin_step(1, Counters(required_samples=8))
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and loop.time() - started < 3
    assert "BeginTrainingStep(1) failed: UNAVAILABLE" in str(info.value)

    calls = []

    async def refused(request, timeout):
        calls.append(1)
        raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="out of order")

    with pytest.raises(StepProtocolError):
        await _steps(refused, 5).begin_step(1, Counters(required_samples=8))
    assert calls == [1]
