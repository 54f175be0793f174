"""Bounds of the trainer's checks, torch-free so that config loading can name them as defaults."""

from __future__ import annotations

DEFAULT_LOGPROB_MISMATCH_BOUND = 0.1
"""Nats per token: the largest mean absolute difference between the rollout engine's log-probabilities of
on-policy samples and the trainer's recomputation (``actor.logprob_mismatch_bound``).

Measured with the torch engine and trainer on CPU in fp32, the quick start and the multi-turn example under both
dependency sets (``constraints/cpu.txt``, ``constraints/gpu-pins.txt``): 1e-7 to 1e-6 when both sides compute the
same model; 2.1 (quick start) and 6.1 (multi-turn) when the engine decoded without its KV cache (transformers
before 5.24, before :mod:`modeling.versions`). In bf16 on a GPU the engine's and the trainer's kernels differ:
figures published for vLLM against FSDP trainers lie around 0.01-0.03 nats (not measured here); 0.1 leaves room
for those and still stops a run whose two sides compute different models."""
