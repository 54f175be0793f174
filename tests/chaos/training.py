"""What the chaos tests read of a training run: its step records and how it ended."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc

from rollmesh.trainer.v1 import trainer_agent_pb2, trainer_agent_pb2_grpc


def steps(path: Path) -> list[dict]:
    """The step records of ``steps.jsonl`` so far (a last line still being written is not one yet)."""
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]   # whatever follows the last newline is unfinished
    return [e for e in (json.loads(line) for line in complete if line) if e.get("event") == "step"]


async def outcome(trainer_address: str, deadline: float) -> trainer_agent_pb2.GetTrainingProgressResponse:
    """The trainer's progress once training has FINISHED or FAILED (asserting it does before ``deadline``)."""
    async with grpc.aio.insecure_channel(trainer_address) as channel:
        stub = trainer_agent_pb2_grpc.TrainerAgentServiceStub(channel)
        while True:
            progress = await stub.GetTrainingProgress(trainer_agent_pb2.GetTrainingProgressRequest(), timeout=10)
            if progress.state in (trainer_agent_pb2.TRAINING_STATE_FINISHED, trainer_agent_pb2.TRAINING_STATE_FAILED):
                return progress
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.2)
