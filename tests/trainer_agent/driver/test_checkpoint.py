"""Checkpoint and restore: the model and optimizer bit for bit, and no sample lost across a restart."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollmesh.controller.v1 import scheduling_pb2

from trainer_agent.driver.checkpoint import load_checkpoint, save_checkpoint
from trainer_agent.driver.loop import FullyAsyncLoop, task_prompts
from trainer_agent.driver.rollouter import GenerationResult, RolloutConfig, Segment
from trainer_agent.training import task
from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer, Sample
from trainer_agent.weight_source import TorchWeightSource

pytestmark = pytest.mark.timeout(120)

SEED = 4
N = 2
ROLLOUT = RolloutConfig(n=N, ppo_mini_batch_size=2, trigger_parameter_sync_step=1, staleness_threshold=1.0,
                        max_tokens=2, max_retries=0)


def _source() -> TorchWeightSource:
    source = TorchWeightSource("tiny-llama", seed=SEED)
    source.load()
    return source


def _groups() -> list[list[Sample]]:
    prompt = [task.DIGIT_IDS[3], task.SEPARATOR_ID]
    return [[Sample(prompt, [task.DIGIT_IDS[3], task.EOS_ID], [-2.0, -2.0], 1.0),
             Sample(prompt, [task.DIGIT_IDS[5], task.EOS_ID], [-2.5, -1.0], 0.0)]]


def _params(trainer: GrpoTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_weights()}


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_restored_trainer_continues_bit_for_bit(offloaded):
    a = GrpoTrainer.from_weight_source(_source(), GrpoConfig(lr=3e-3))
    for _ in range(2):
        a.step(_groups())
    if offloaded:
        a.offload()
    state = a.state_dict()
    if offloaded:
        a.onload()
    b = GrpoTrainer.from_weight_source(_source(), GrpoConfig(lr=3e-3))
    b.load_state_dict(state)
    assert b.weight_version == a.weight_version == b.weight_source.weight_version == 2
    assert all(torch.equal(t, _params(a)[n]) for n, t in _params(b).items())
    a.step(_groups())
    b.step(_groups())  # the AdamW moments came along: the next update is identical too
    assert all(torch.equal(t, _params(a)[n]) for n, t in _params(b).items())


def test_a_checkpoint_file_round_trips(tmp_path):
    a = GrpoTrainer.from_weight_source(_source())
    a.step(_groups())
    save_checkpoint(tmp_path, trainer_state=a.state_dict(), driver_state={"x": 1}, records=[{"global_step": 1}])
    payload = load_checkpoint(tmp_path)
    assert payload["driver"] == {"x": 1} and payload["records"] == [{"global_step": 1}]
    assert payload["trainer"]["weight_version"] == 1
    assert load_checkpoint(tmp_path / "empty") is None


class _Controller:
    async def BeginTrainingStep(self, request, timeout=None):  # noqa: N802
        return scheduling_pb2.BeginTrainingStepResponse()

    async def CompleteTrainingStep(self, request, timeout=None):  # noqa: N802
        return scheduling_pb2.CompleteTrainingStepResponse()


class _Generate:
    """Answers at once while open; when closed, index-0 samples still finish but the others hang."""

    def __init__(self) -> None:
        self.open = True
        self.request_ids: list[str] = []
        self._never = asyncio.Event()

    async def __call__(self, request):
        self.request_ids.append(request.request_id)
        index = int(request.request_id.split("/")[1].split("@")[0])
        if not self.open and index > 0:
            await self._never.wait()
        await asyncio.sleep(0)
        return GenerationResult([Segment([task.DIGIT_IDS[1], task.EOS_ID], [-1.0, -1.5], weight_version=0)])


async def _one() -> int:
    return 1


def _loop(generate, on_step=None) -> tuple[FullyAsyncLoop, GrpoTrainer]:
    # the fake generator's logprobs are made up, not the model's: no on-policy check
    trainer = GrpoTrainer.from_weight_source(_source(), GrpoConfig(lr=3e-3, logprob_mismatch_bound=0))
    loop = FullyAsyncLoop(_Controller(), generate, trainer, ROLLOUT, task_prompts(task, 8, SEED), task.reward,
                          replica_count=_one, max_queue_size=16, collect_timeout_s=30, replica_poll_s=0.05,
                          on_step=on_step)
    return loop, trainer


async def test_a_restart_keeps_queued_and_half_finished_samples():
    first = _Generate()
    saved: dict = {}

    async def checkpoint_after_step_two(record) -> None:
        if record.global_step != 2:
            return
        first.open = False
        for _ in range(200):  # let the rollouter admit groups whose second sample now hangs
            await asyncio.sleep(0)
        saved["driver"], saved["trainer"] = loop_a.state_dict(), trainer_a.state_dict()
        saved["params"] = _params(trainer_a)

    loop_a, trainer_a = _loop(first, checkpoint_after_step_two)
    await loop_a.run(2)
    state = saved["driver"]
    queued = [s["group_id"] for s in state["queue"]["samples"]]
    half = [g for g in state["rollouter"]["pending"] if g["done"]]
    assert queued and half, "the checkpoint should hold queued samples and half-finished groups"
    q = state["queue"]
    assert q["generated"] == q["consumed"] + q["dropped"] + len(q["samples"])

    second = _Generate()
    loop_b, trainer_b = _loop(second)
    trainer_b.load_state_dict(saved["trainer"])
    loop_b.load_state_dict(state)
    assert all(torch.equal(t, saved["params"][n]) for n, t in _params(trainer_b).items())
    records = await loop_b.run(2)

    assert [r.global_step for r in records] == [3, 4] and [r.weight_version for r in records] == [3, 4]
    last = records[-1]
    assert last.consumed == 4 * ROLLOUT.required_completions   # the queue counts completions
    assert last.generated == last.consumed + last.dropped + last.queue_size
    assert last.dropped == 0
    # Half-finished groups asked only for their missing samples; their finished ones were kept.
    for group in half:
        done = {d["index"] for d in group["done"]}
        asked = {int(rid.split("/")[1].split("@")[0]) for rid in second.request_ids
                 if rid.split("/")[0] == group["group_id"]}
        assert asked == set(range(N)) - done, (group["group_id"], asked, done)
    # The data source resumed after the prompts already taken: the first new group takes the next prompt.
    pending = {g["group_id"] for g in state["rollouter"]["pending"]}
    new_groups = [rid.split("/")[0] for rid in second.request_ids if rid.split("/")[0] not in pending]
    taken = state["rollouter"]["prompts_taken"]
    assert new_groups[0] == f"p{taken % 8}#{state['rollouter']['groups_admitted']}"
