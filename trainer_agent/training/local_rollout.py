"""Sampling with plain torch, no replicas: rollouts for tests and smoke runs of :class:`~.grpo.GrpoTrainer`.

:func:`sample_group` draws completions at temperature 1 and records the
logprob of every sampled token, as a replica engine would report it.
:func:`train_toy_task` runs the whole loop (sample, score, GRPO step) on the
built-in copy task (:mod:`.task`) and returns the reward curve.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence

import torch

from . import task
from .grpo import GrpoTrainer, Sample


@torch.no_grad()
def sample_group(model: torch.nn.Module, prompt_ids: Sequence[int], group_size: int, max_new_tokens: int, *,
                 generator: torch.Generator, stop_id: int | None = task.EOS_ID) -> list[Sample]:
    """``group_size`` completions of one prompt, temperature 1, each cut after its first ``stop_id``."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokens = torch.tensor([list(prompt_ids)] * group_size, dtype=torch.long, device=device)
    sampled, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=tokens).logits[:, -1].float()
        log_dist = torch.log_softmax(logits, dim=-1)
        next_tokens = torch.multinomial(log_dist.exp().cpu(), 1, generator=generator).to(device)
        sampled.append(next_tokens[:, 0])
        logprobs.append(log_dist.gather(-1, next_tokens)[:, 0])
        tokens = torch.cat([tokens, next_tokens], dim=1)
    model.train(was_training)
    sampled_rows = torch.stack(sampled, dim=1).tolist()
    logprob_rows = torch.stack(logprobs, dim=1).tolist()
    samples = []
    for completion, lps in zip(sampled_rows, logprob_rows):
        if stop_id is not None and stop_id in completion:
            cut = completion.index(stop_id) + 1
            completion, lps = completion[:cut], lps[:cut]
        samples.append(Sample(list(prompt_ids), completion, lps))
    return samples


@dataclasses.dataclass(frozen=True)
class ToyRun:
    """Result of :func:`train_toy_task`."""

    mean_rewards: list[float]
    """Mean reward of each step's rollouts (scored before that step's update)."""
    exact_match: list[float]
    """Share of each step's rollouts that are the exact answer + EOS."""
    seconds: float
    """Wall-clock time of the whole run."""


def train_toy_task(trainer: GrpoTrainer, *, steps: int, prompts_per_step: int = 8, group_size: int = 8,
                   seed: int = 0, min_digits: int = 3, max_digits: int = 3, radix: int = 10) -> ToyRun:
    """Train ``trainer`` on the copy task for ``steps`` GRPO steps; deterministic in ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    prompt_seeds = random.Random(seed)
    rewards, exact = [], []
    started = time.perf_counter()
    for _ in range(steps):
        pairs = task.make_prompts(prompts_per_step, prompt_seeds.randrange(2**31), min_digits=min_digits,
                                  max_digits=max_digits, radix=radix)
        groups = [sample_group(trainer.model, prompt, group_size, task.max_completion_tokens(prompt),
                               generator=generator) for prompt, _ in pairs]
        result = trainer.step(groups, reward_fn=task.reward)
        rewards.append(result.metrics["critic/rewards/mean"])
        exact.append(sum(list(s.completion_ids) == answer for (_, answer), g in zip(pairs, groups) for s in g)
                     / (prompts_per_step * group_size))
    return ToyRun(rewards, exact, time.perf_counter() - started)
