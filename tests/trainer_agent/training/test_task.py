"""The copy task: deterministic prompts, rewards computed by hand."""

from __future__ import annotations

import pytest

from trainer_agent.training import task

pytestmark = pytest.mark.timeout(120)

D = task.DIGIT_IDS
SEP, EOS = task.SEPARATOR_ID, task.EOS_ID


def test_prompts_are_deterministic_and_well_formed():
    pairs = task.make_prompts(20, seed=7, min_digits=3, max_digits=5)
    assert pairs == task.make_prompts(20, seed=7, min_digits=3, max_digits=5)
    assert pairs != task.make_prompts(20, seed=8, min_digits=3, max_digits=5)
    for prompt, answer in pairs:
        assert 3 <= len(prompt) - 1 <= 5 and prompt[-1] == SEP
        assert answer == prompt[:-1] + [EOS]
        assert all(t in D for t in prompt[:-1])


def test_reward_by_hand():
    prompt = [D[1], D[2], D[3], SEP]
    assert task.reward(prompt, [D[1], D[2], D[3], EOS]) == pytest.approx(1.0)
    assert task.reward(prompt, [D[1], D[2], D[3], EOS, 99]) == pytest.approx(1.0)  # after EOS: ignored
    # 2 leading right of 4, all 4 in the alphabet: 0.8 * 2/4 + 0.2 * 4/4
    assert task.reward(prompt, [D[1], D[2], D[9], EOS]) == pytest.approx(0.6)
    # exact digits but no EOS: 3/4 prefix, 3 of 4 in the alphabet
    assert task.reward(prompt, [D[1], D[2], D[3], 200]) == pytest.approx(0.8 * 0.75 + 0.2 * 0.75)
    assert task.reward(prompt, [200, 201]) == 0.0
    assert task.reward(prompt, [D[5]]) == pytest.approx(0.2 * 0.25)
