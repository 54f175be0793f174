"""GetTrainingProgress and Offload/OnloadTrainingState against a real trainer-agent gRPC server."""

from __future__ import annotations

import asyncio

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
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(include_optimizer=True), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(info.value).reason == "NO_TRAINING_LOOP"
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
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.OffloadTrainingState(pb.OffloadTrainingStateRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(info.value).reason == "TRAINING_STEP_RUNNING"
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
