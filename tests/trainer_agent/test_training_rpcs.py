"""GetTrainingProgress and Offload/OnloadTrainingState against a real trainer-agent gRPC server."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest
from rollmesh.trainer.v1 import trainer_agent_pb2 as pb
from rollmesh.trainer.v1 import trainer_agent_pb2_grpc

from mesh_runtime.config import ConfigError, load_config
from mesh_runtime.errors import error_info
from weight_transfer import WeightTransferConfig
from trainer_agent.config import TrainerAgentConfig
from trainer_agent.driver.settings import DriverSettings
from trainer_agent.server import SPEC
from trainer_agent.training.grpo import GrpoTrainer, parameter_bytes

pytestmark = pytest.mark.timeout(120)


async def refused(call, code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    """The error ``call`` fails with, checked to have ``code`` and ErrorInfo ``reason``."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code
    assert error_info(info.value).reason == reason
    return info.value


async def _serve(**driver):
    config = TrainerAgentConfig(listen="127.0.0.1:0", weight_transfer=WeightTransferConfig(gloo_interface="lo"),
                                driver=DriverSettings(**driver))
    config.validate()
    server, port = await SPEC.create(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, trainer_agent_pb2_grpc.TrainerAgentServiceStub(channel)


async def test_progress_is_idle_and_offload_refused_without_a_training_loop():
    server, channel, stub = await _serve()
    try:
        progress = await stub.GetTrainingProgress(pb.GetTrainingProgressRequest(), timeout=10)
        assert progress.state == pb.TRAINING_STATE_IDLE and progress.global_step == 0
        assert not progress.HasField("last_reward_mean")
        await refused(stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(include_optimizer=True), timeout=10),
                      grpc.StatusCode.FAILED_PRECONDITION, "NO_TRAINING_LOOP")
        status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        assert {"progress", "offload"} <= set(status.status.capabilities)
    finally:
        await channel.close()
        await server.stop(0)


async def test_offload_and_onload_move_the_trainers_state_between_steps():
    server, channel, stub = await _serve()
    try:
        driver = server.services[0].servicer.node.driver
        driver.trainer = GrpoTrainer.from_weight_source(driver.source)
        weights = parameter_bytes(driver.trainer.model)
        moved = await stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(include_optimizer=True), timeout=10)
        assert moved.bytes_moved == weights and driver.trainer.offloaded
        again = await stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(include_optimizer=True), timeout=10)
        assert again.bytes_moved == 0
        back = await stub.OnloadTrainingState(pb.OnloadTrainingStateRequest(), timeout=10)
        assert back.bytes_moved == weights and not driver.trainer.offloaded
        driver.state = "TRAINING"
        await refused(stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(), timeout=10),
                      grpc.StatusCode.FAILED_PRECONDITION, "TRAINING_STEP_RUNNING")
    finally:
        await channel.close()
        await server.stop(0)


async def test_a_driver_that_cannot_reach_the_mesh_reports_failed_not_finished():
    server, channel, stub = await _serve(enabled=True, controller_address="127.0.0.1:9",
                                         load_balancer_address="127.0.0.1:9", start_timeout_s=1.0)
    try:
        for _ in range(100):
            progress = await stub.GetTrainingProgress(pb.GetTrainingProgressRequest(), timeout=10)
            if progress.state != pb.TRAINING_STATE_IDLE:
                break
            await asyncio.sleep(0.1)
        assert progress.state == pb.TRAINING_STATE_FAILED
        assert "not ready" in progress.error_message
    finally:
        await channel.close()
        await server.stop(0)


@pytest.mark.parametrize("overrides, key", [
    ({"driver": {"enabled": True}}, "driver.controller_address"),
    ({"driver": {"total_training_steps": 0}}, "driver.total_training_steps"),
    ({"async_training": {"staleness_threshold": -1}}, "async_training.staleness_threshold"),
    ({"actor_rollout_ref": {"rollout": {"n": 1}}}, "actor_rollout_ref.rollout.n"),
    ({"actor_rollout_ref": {"actor": {"optim": {"lr": 0}}}}, "actor_rollout_ref.actor.optim.lr"),
    ({"async_training": {"max_queue_size": 7}}, "async_training.max_queue_size"),   # one collection: 8 prompts
    ({"task": {"radix": 11}}, "task.radix"),
])
def test_driver_settings_are_checked_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(TrainerAgentConfig, overrides=overrides)
    assert info.value.key == key, str(info.value)


async def test_stop_training_checks_the_step_and_moves_the_end():
    # the driver waits for a mesh that never answers: no loop yet, state IDLE
    server, channel, stub = await _serve(enabled=True, controller_address="127.0.0.1:9",
                                         load_balancer_address="127.0.0.1:9", start_timeout_s=600.0,
                                         total_training_steps=10)
    try:
        driver = server.services[0].servicer.node.driver
        for after_step in (0, 11):
            err = await refused(stub.StopTraining(pb.StopTrainingRequest(after_step=after_step), timeout=10),
                                grpc.StatusCode.INVALID_ARGUMENT, "INVALID_STOP_STEP")
            assert "1..10" in err.details()
        progress = await stub.GetTrainingProgress(pb.GetTrainingProgressRequest(), timeout=10)
        assert progress.final_step == 10   # the refusals changed nothing
        assert (await stub.StopTraining(pb.StopTrainingRequest(after_step=7), timeout=10)).final_step == 7
        assert (await stub.GetTrainingProgress(pb.GetTrainingProgressRequest(), timeout=10)).final_step == 7
        # before any step runs, an unset after_step ends training before a further step
        assert (await stub.StopTraining(pb.StopTrainingRequest(), timeout=10)).final_step == 0

        # a loop running step 5: the end can move later, or to step 5, never before it
        driver.loop = types.SimpleNamespace(last_step=None)
        driver.records = [types.SimpleNamespace(global_step=4, weight_version=4, reward_mean=0.5)]
        err = await refused(stub.StopTraining(pb.StopTrainingRequest(after_step=4), timeout=10),
                            grpc.StatusCode.FAILED_PRECONDITION, "STEP_ALREADY_PASSED")
        assert error_info(err).metadata["running_step"] == "5"
        assert driver.loop.last_step is None
        assert (await stub.StopTraining(pb.StopTrainingRequest(after_step=9), timeout=10)).final_step == 9
        assert driver.loop.last_step == 9
        assert (await stub.StopTraining(pb.StopTrainingRequest(), timeout=10)).final_step == 5
        assert driver.loop.last_step == 5

        driver.state = "FINISHED"
        await refused(stub.StopTraining(pb.StopTrainingRequest(), timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                      "TRAINING_ENDED")
    finally:
        await channel.close()
        await server.stop(0)


async def test_stop_training_is_refused_where_no_training_loop_runs():
    server, channel, stub = await _serve()
    try:
        await refused(stub.StopTraining(pb.StopTrainingRequest(after_step=1), timeout=10),
                      grpc.StatusCode.FAILED_PRECONDITION, "NO_TRAINING_LOOP")
    finally:
        await channel.close()
        await server.stop(0)
