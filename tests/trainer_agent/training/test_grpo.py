"""GrpoTrainer: advantages and loss by hand, rollout-logprob correction, publishing, offload, learning."""

from __future__ import annotations

import math

import pytest
import torch

from mesh_runtime.errors import FailedPrecondition, InvalidArgument
from modeling.presets import build_preset_model
from trainer_agent.training import task
from trainer_agent.training.grpo import (GrpoConfig, GrpoTrainer, Sample, clipped_policy_loss, completion_logprobs,
                                         group_advantages, parameter_bytes)
from trainer_agent.training.local_rollout import sample_group, train_toy_task
from trainer_agent.weight_source import TorchWeightSource

pytestmark = [pytest.mark.timeout(120), pytest.mark.pins]

PROMPT = [task.DIGIT_IDS[1], task.DIGIT_IDS[2], task.DIGIT_IDS[3], task.SEPARATOR_ID]


def trainer(seed: int = 0, **config) -> GrpoTrainer:
    return GrpoTrainer(build_preset_model("tiny-llama", seed), GrpoConfig(**config))


def current_logprobs(t: GrpoTrainer, samples: list[Sample]) -> list[list[float]]:
    with torch.no_grad():
        logprobs, mask = completion_logprobs(t.model, samples, t.device)
    return [row[m].tolist() for row, m in zip(logprobs, mask)]


def test_group_advantages_by_hand():
    # mean 1, sample std 1 -> -1, 0, 1; mean 0.5, std sqrt(1/3) -> +-sqrt(3)/2
    got = group_advantages([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0, 1.0], [0.3, 0.3], [5.0]], eps=0.0)
    assert got[0] == pytest.approx([-1.0, 0.0, 1.0])
    h = math.sqrt(3) / 2
    assert got[1] == pytest.approx([h, -h, -h, h])
    assert got[2] == [0.0, 0.0]  # no spread: no signal
    assert got[3] == [0.0]


def test_clipped_loss_by_hand_with_one_clipped_token():
    # sample 1 (A = +1): ratios 1.1 (inside) and 1.5 (clipped to 1.2); sample 2 (A = -1): ratio 0.9, one padded token
    rollout = torch.zeros(2, 2)
    logprobs = torch.log(torch.tensor([[1.1, 1.5], [0.9, 1.0]])).requires_grad_()
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([[1.0], [-1.0]])
    loss, stats = clipped_policy_loss(logprobs, rollout, advantages, mask, clip_ratio=0.2)
    assert loss.item() == pytest.approx(-(1.1 + 1.2 - 0.9) / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of -ratio*A/3 = -ratio*A/3 where unclipped; 0 where clipped or padded
    assert logprobs.grad.flatten().tolist() == pytest.approx([-1.1 / 3, 0.0, 0.9 / 3, 0.0])


def test_step_uses_rollout_logprobs_as_the_behaviour_policy():
    t = trainer()
    completions = [[task.DIGIT_IDS[1], task.EOS_ID], [200, 201]]
    samples = [Sample(PROMPT, c, [0.0] * len(c)) for c in completions]
    now = current_logprobs(t, samples)
    # Rollout logprobs as if sampled by older weights: ratio 2 on the good sample (A > 0), 0.5 on the bad one
    # (A < 0): PPO clips both, so the update leaves the weights alone.
    stale = [Sample(PROMPT, c, [lp - math.log(2) for lp in now[0]], reward=1.0) for c in completions[:1]] + \
            [Sample(PROMPT, completions[1], [lp + math.log(2) for lp in now[1]], reward=0.0)]
    before = {n: w.clone() for n, w in t.named_weights()}
    result = t.step([stale])
    assert result.metrics["actor/pg_clipfrac"] == pytest.approx(1.0)
    assert result.metrics["actor/ratio_mean"] == pytest.approx((2 + 2 + 0.5 + 0.5) / 4, rel=1e-4)
    assert result.metrics["actor/grad_norm"] == 0.0
    assert all(torch.equal(before[n], w) for n, w in t.named_weights())

    # The same samples with on-policy logprobs: ratio 1, nothing clipped, the weights move.
    fresh = [Sample(PROMPT, c, now[i], reward=float(i == 0)) for i, c in enumerate(completions)]
    result = t.step([fresh])
    assert result.metrics["actor/pg_clipfrac"] == 0.0
    assert result.metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert result.metrics["actor/grad_norm"] > 0
    assert not all(torch.equal(before[n], w) for n, w in t.named_weights())
    assert result.weight_version == 2


def test_step_reports_timing_under_the_controller_keys():
    t = trainer()
    group = sample_group(t.model, PROMPT, 4, 4, generator=torch.Generator().manual_seed(0))
    result = t.step([group], reward_fn=task.reward)
    for key in ("reward", "old_log_prob", "adv", "update_actor"):
        assert result.timing_raw[key] > 0
    assert result.timing_raw["ref"] == result.timing_raw["values"] == result.timing_raw["update_critic"] == 0
    assert result.metrics["critic/rewards/mean"] == pytest.approx(
        sum(task.reward(s.prompt_ids, s.completion_ids) for s in group) / 4)


def test_bad_batches_are_invalid_arguments():
    t = trainer()
    with pytest.raises(InvalidArgument):
        t.step([])
    with pytest.raises(InvalidArgument):
        t.step([[Sample(PROMPT, [1, 2], [0.0])]])


def test_publishes_in_place_to_the_weight_source_it_trains():
    source = TorchWeightSource("tiny-llama", seed=0)
    source.load()
    t = GrpoTrainer.from_weight_source(source, GrpoConfig(lr=1e-2))
    group = sample_group(t.model, PROMPT, 4, 4, generator=torch.Generator().manual_seed(1))
    group = [Sample(s.prompt_ids, s.completion_ids, s.rollout_logprobs, reward=float(i)) for i, s in enumerate(group)]
    result = t.step([group])
    assert result.weight_version == source.weight_version == 1
    snapshot = source.snapshot()
    assert snapshot.weight_version == 1
    assert all(torch.equal(w, dict(t.named_weights())[n]) for n, w in snapshot.tensors)


def test_publishes_a_separate_model_through_set_weights():
    source = TorchWeightSource("tiny-qwen2", seed=0, weight_version=5)
    source.load()
    t = GrpoTrainer(build_preset_model("tiny-qwen2", 0), GrpoConfig(lr=1e-2), weight_source=source)
    names = [n for n, _ in t.named_weights()]
    assert names == [s.name for s in source.weight_spec()]  # HF names, tied embedding once
    group = sample_group(t.model, PROMPT, 4, 4, generator=torch.Generator().manual_seed(2))
    group = [Sample(s.prompt_ids, s.completion_ids, s.rollout_logprobs, reward=float(i)) for i, s in enumerate(group)]
    assert t.step([group]).weight_version == source.weight_version == 6
    trained = dict(t.named_weights())
    assert all(torch.equal(w, trained[n]) for n, w in source.named_weights())


def test_offload_frees_parameter_memory_and_onload_restores_it_bit_for_bit():
    t, twin = trainer(lr=1e-2), trainer(lr=1e-2)  # same seed, same history; only t goes through offload
    group = sample_group(t.model, PROMPT, 4, 4, generator=torch.Generator().manual_seed(3))
    group = [Sample(s.prompt_ids, s.completion_ids, s.rollout_logprobs, reward=float(i)) for i, s in enumerate(group)]
    t.step([group])
    twin.step([group])
    full = parameter_bytes(t.model)
    weights = {n: w.clone() for n, w in t.named_weights()}
    states = {n: {k: v.clone() for k, v in t.optimizer.state[p].items()} for n, p in t._params.items()}

    t.offload()
    t.offload()  # idempotent
    assert parameter_bytes(t.model) == 0
    assert all(not t.optimizer.state[p] for p in t._params.values())
    host = t.host_storage()
    assert sum(v.numel() * v.element_size() for v in host.values()) == full
    with pytest.raises(FailedPrecondition):
        t.step([group])

    t.onload()
    assert parameter_bytes(t.model) == full and not t.host_storage()
    assert all(torch.equal(weights[n], w) for n, w in t.named_weights())
    for n, p in t._params.items():
        assert states[n].keys() == t.optimizer.state[p].keys()
        assert all(torch.equal(states[n][k], t.optimizer.state[p][k]) for k in states[n])
    # The optimizer goes on from where it was: same result as a trainer that never offloaded.
    t.step([group])
    twin.step([group])
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(t.named_weights(), twin.named_weights()))


@pytest.mark.parametrize("seed", [0, 1])
def test_reward_rises_on_the_copy_task(seed):
    torch.set_num_threads(2)
    run = train_toy_task(trainer(seed, lr=3e-3), steps=30, prompts_per_step=8, group_size=8, seed=seed)
    first, last = sum(run.mean_rewards[:5]) / 5, sum(run.mean_rewards[-5:]) / 5
    assert last > first + 0.1, run.mean_rewards
    assert run.seconds < 60


# -- the on-policy check: the engine's and the trainer's logprobs of the same weights must agree ----------------


def _on_policy(t: GrpoTrainer, shift: float = 0.0, version: int | None = 0) -> list[list[Sample]]:
    completions = [[task.DIGIT_IDS[1], task.EOS_ID], [task.DIGIT_IDS[2], task.DIGIT_IDS[3], task.EOS_ID]]
    plain = [Sample(PROMPT, c, [0.0] * len(c)) for c in completions]
    now = current_logprobs(t, plain)
    return [[Sample(PROMPT, c, [lp + shift for lp in now[i]], reward=float(i), weight_version=version)
             for i, c in enumerate(completions)]]


def test_on_policy_samples_that_agree_train_and_report_the_difference():
    t = trainer()
    result = t.step(_on_policy(t))
    assert result.metrics["actor/on_policy_logprob_abs_diff"] <= 1e-6
    assert result.metrics["actor/on_policy_tokens"] == 5
    assert t.weight_version == 1


def test_a_mismatch_on_on_policy_samples_stops_the_step_before_any_update():
    from trainer_agent.training.grpo import LogprobMismatch

    t = trainer()
    before = {n: w.clone() for n, w in t.named_weights()}
    with pytest.raises(LogprobMismatch) as caught:
        t.step(_on_policy(t, shift=0.5))
    message = str(caught.value)
    assert "0.5 nats per token" in message and "bound 0.1" in message and "logprob_mismatch_bound" in message
    assert f"torch {torch.__version__}" in message and "transformers " in message
    assert caught.value.reason == "LOGPROB_MISMATCH" and caught.value.metadata["difference"].startswith("0.5")
    assert t.weight_version == 0 and all(torch.equal(before[n], w) for n, w in t.named_weights())


def test_warn_trains_through_a_mismatch_and_logs_it(caplog):
    t = trainer(logprob_mismatch_action="warn")
    with caplog.at_level("WARNING", logger="trainer_agent.training.grpo"):
        result = t.step(_on_policy(t, shift=0.5))
    assert result.metrics["actor/on_policy_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-5)
    assert t.weight_version == 1 and "differ from the trainer's by 0.5" in caplog.text


@pytest.mark.parametrize("version", [None, 3])
def test_samples_of_other_or_mixed_versions_are_not_checked(version):
    t = trainer()   # version 0; stale samples legitimately differ, the importance ratio corrects for them
    result = t.step(_on_policy(t, shift=0.5, version=version))
    assert "actor/on_policy_logprob_abs_diff" not in result.metrics and t.weight_version == 1


def test_a_zero_bound_turns_the_check_off():
    t = trainer(logprob_mismatch_bound=0)
    assert t.step(_on_policy(t, shift=3.0)).metrics["actor/on_policy_logprob_abs_diff"] == pytest.approx(3.0, abs=1e-5)


def test_the_trainer_scores_tokens_at_the_rollouts_temperature():
    t = trainer()
    samples = [Sample(PROMPT, [task.DIGIT_IDS[4], task.EOS_ID], [0.0, 0.0])]
    with torch.no_grad():
        cooled, _ = completion_logprobs(t.model, samples, t.device, temperature=0.5)
        ids = torch.tensor([[*PROMPT, task.DIGIT_IDS[4], task.EOS_ID]])
        logits = t.model(input_ids=ids).logits[0, len(PROMPT) - 1:-1] / 0.5
    expected = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(PROMPT):, None])[:, 0]
    assert torch.allclose(cooled[0], expected, atol=1e-6)


@pytest.mark.parametrize("config, field", [({"temperature": 0}, "temperature"),
                                           ({"logprob_mismatch_action": "ignore"}, "logprob_mismatch_action")])
def test_bad_check_settings_are_refused(config, field):
    with pytest.raises(InvalidArgument, match=field):
        GrpoConfig(**config)
