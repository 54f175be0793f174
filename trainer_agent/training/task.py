"""A built-in, verifiable toy task for the trainer: copy a short digit string.

The task lives on the replica presets' small vocabulary (256 ids,
:mod:`modeling.presets`), so a randomly initialised tiny model can
learn it with a few GRPO steps on CPU; tests and smoke runs use it to check
that reward actually rises.

Token layout (the presets have no tokenizer; these ids are just chosen):

- ``DIGIT_IDS`` = 10..19 stand for the digits 0..9;
- ``SEPARATOR_ID`` = 2 ends the prompt;
- ``EOS_ID`` = 1 ends the answer.

A prompt is ``d1 .. dk SEP`` (``k`` digits, ``k`` in ``[min_digits, max_digits]``);
the answer is ``d1 .. dk EOS``. Everything is deterministic in ``seed``.

Reward of a completion (in ``[0, 1]``)::

    reward = (1 - SHAPING_WEIGHT) * exact_prefix + SHAPING_WEIGHT * in_alphabet

- ``exact_prefix``: the number of leading completion tokens that equal the
  answer, divided by the answer length (digits + EOS). It is 1 only for the
  exact copy followed by EOS; tokens after the EOS are ignored (a sampler
  stops there).
- ``in_alphabet`` (the shaping term): the fraction of the first
  ``len(answer)`` completion positions that hold a digit or EOS at all. A
  random model almost never emits a digit (10 of 256 ids), so without it the
  first groups carry no signal; with weight 0.2 it only rewards "speak the
  task's alphabet", never a wrong answer over a right one.

Measured (tiny-llama, lr 3e-3, 8 prompts x 8 samples, 3 digits, radix 10):
the mean reward goes from ~0.01 to ~0.2-0.25 within ~20 steps (~1 s on 2
CPU threads), mostly by learning the alphabet (and some leading digits);
exact copies do not emerge within 100 steps, where the policy tends to
settle on digit strings that the groups no longer tell apart.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

DIGIT_IDS: tuple[int, ...] = tuple(range(10, 20))
"""Token ids of the digits 0..9."""
SEPARATOR_ID = 2
"""Ends the prompt."""
EOS_ID = 1
"""Ends the answer; a sampler should stop on it."""
SHAPING_WEIGHT = 0.2
"""Share of the reward given for emitting task tokens (digits or EOS) at all."""

_ALPHABET = frozenset(DIGIT_IDS) | {EOS_ID}


def make_prompts(n: int, seed: int, *, min_digits: int = 3, max_digits: int = 3,
                 radix: int = 10) -> list[tuple[list[int], list[int]]]:
    """``n`` deterministic ``(prompt_token_ids, answer_token_ids)`` pairs of the copy task.

    Digits are drawn from the first ``radix`` digit tokens (``radix=2``: binary strings).
    """
    if not 2 <= radix <= len(DIGIT_IDS):
        raise ValueError(f"radix must lie in [2, {len(DIGIT_IDS)}], got {radix}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        digits = [rng.choice(DIGIT_IDS[:radix]) for _ in range(rng.randint(min_digits, max_digits))]
        pairs.append((digits + [SEPARATOR_ID], answer_for(digits + [SEPARATOR_ID])))
    return pairs


def answer_for(prompt: Sequence[int]) -> list[int]:
    """The correct completion of ``prompt``: its digits, then EOS."""
    if not prompt or prompt[-1] != SEPARATOR_ID:
        raise ValueError("a copy-task prompt ends with the separator token")
    return [*prompt[:-1], EOS_ID]


def max_completion_tokens(prompt: Sequence[int]) -> int:
    """How many tokens a sampler needs to produce the full answer (digits + EOS)."""
    return len(prompt)


def reward(prompt: Sequence[int], completion_token_ids: Sequence[int]) -> float:
    """Score ``completion_token_ids`` for ``prompt`` in ``[0, 1]``; 1 only for the exact copy + EOS."""
    answer = answer_for(prompt)
    completion = list(completion_token_ids)
    prefix = 0
    for got, want in zip(completion, answer):
        if got != want:
            break
        prefix += 1
    window = completion[:len(answer)]
    in_alphabet = sum(token in _ALPHABET for token in window) / len(answer)
    return (1.0 - SHAPING_WEIGHT) * prefix / len(answer) + SHAPING_WEIGHT * in_alphabet
