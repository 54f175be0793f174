"""Sample arithmetic of fully-async training, written once, as verl's trainer and rollouter compute it.

Unit: a *sample* is one prompt together with its ``rollout.n`` responses
(one GRPO group), as one ``RolloutSample`` in verl's message queue. Every
count the step protocol carries (``required_samples``, ``expected_samples``,
``buffer_samples``, ``total_generated_samples``, ``step_wait_samples``,
``queue_size``, ``deactivate_wait_samples``) is in this unit, and so is
``actor_rollout_ref.actor.ppo_mini_batch_size``: prompts, everywhere.

The formulas (verl ``fully_async_trainer.py`` / ``fully_async_rollouter.py``):

* ``required_samples = ppo_mini_batch_size x require_batches`` (one collection);
* ``step_required_samples = required_samples x trigger_parameter_sync_step``
  (one weight-sync cycle);
* ``expected_samples = step_required_samples x completed_steps`` where the
  rollouter's ``completed_steps`` starts at 1 and grows by one per sync
  cycle, so during global step ``g`` (1-based) it is ``g``;
* ``buffer_samples = step_required_samples x staleness_threshold`` - a float,
  constant for the whole run, *not* ``expected x staleness`` (the reference
  document's wording) and not rounded;
* ``max_required_samples = int(required_samples x (staleness_threshold + 1)
  x trigger_parameter_sync_step)``: the rollouter's staleness budget per
  parameter version, the default queue bound and the concurrency cap.

This module imports nothing of rollmesh's servers; the controller core, the
trainer driver, the simulator and the job config all use it.
"""

from __future__ import annotations


def required_samples(ppo_mini_batch_size: int, require_batches: int) -> int:
    """Prompts per collection: ``ppo_mini_batch_size x require_batches``."""
    return int(ppo_mini_batch_size) * int(require_batches)


def step_required_samples(required: int, trigger_parameter_sync_step: int) -> int:
    """Prompts per weight-sync cycle: ``required_samples x trigger_parameter_sync_step``."""
    return int(required) * int(trigger_parameter_sync_step)


def expected_samples(step_required: int, global_step: int) -> int:
    """Prompts expected by the end of global step ``global_step`` (verl's ``step_required x completed_steps``)."""
    return int(step_required) * int(global_step)


def buffer_samples(step_required: int, staleness_threshold: float) -> float:
    """Allowed headroom: ``step_required_samples x staleness_threshold`` (a float, as in verl)."""
    return step_required * float(staleness_threshold)


def max_required_samples(required: int, staleness_threshold: float, trigger_parameter_sync_step: int) -> int:
    """``int(required x (staleness_threshold + 1) x trigger_parameter_sync_step)``, in verl's order."""
    return int(required * (float(staleness_threshold) + 1) * trigger_parameter_sync_step)


def wait_samples(required: int, queue_size_at_start: int) -> int:
    """Samples of one collection that really had to be waited on: ``max(0, required - queue size at start)``."""
    return max(0, int(required) - int(queue_size_at_start))


class SampleArithmetic:
    """The formulas above as properties, for any config with verl's five fields.

    Mixed into the rollouter's ``RolloutConfig`` and the simulator's
    ``Workload``: they need ``ppo_mini_batch_size``, ``require_batches``,
    ``trigger_parameter_sync_step``, ``staleness_threshold`` and ``n``. The
    ``*_completions`` counts are the sample counts times ``n`` (one response each).
    """

    ppo_mini_batch_size: int
    require_batches: int
    trigger_parameter_sync_step: int
    staleness_threshold: float
    n: int

    @property
    def required_samples(self) -> int:
        """Samples (prompts) per collection."""
        return required_samples(self.ppo_mini_batch_size, self.require_batches)

    @property
    def step_required_samples(self) -> int:
        """Samples (prompts) per weight-sync cycle."""
        return step_required_samples(self.required_samples, self.trigger_parameter_sync_step)

    @property
    def buffer_samples(self) -> float:
        return buffer_samples(self.step_required_samples, self.staleness_threshold)

    @property
    def max_required_samples(self) -> int:
        """Samples (prompts) per parameter version: the staleness budget."""
        return max_required_samples(self.required_samples, self.staleness_threshold,
                                    self.trigger_parameter_sync_step)

    @property
    def required_completions(self) -> int:
        return self.required_samples * self.n

    @property
    def step_completions(self) -> int:
        return self.step_required_samples * self.n

    @property
    def max_required_completions(self) -> int:
        return self.max_required_samples * self.n
