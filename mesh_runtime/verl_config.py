"""verl's ``async_training`` block, accepted as is by every rollmesh config section that has one.

A verl user pastes the ``async_training`` block of ``fully_async_ppo_trainer.yaml``
(or the megatron variant) into ``rollmesh train``'s job config, the
controller's config or the trainer agent's config. Each section honours the
keys it acts on and *accepts* every other key verl defines, reporting it in
one line at start (:func:`split_async_training`); nothing of verl's block is
rejected. A key verl does not define either is accepted and reported too
(verl's block differs between versions), unless it is a near-miss of a key
rollmesh knows (``staleness_treshold``), which is rejected with a
"did you mean" so that a typo never silently falls back to a default.

The defaults shared by several sections live here, once:
:data:`DEACTIVATE_WAIT_TIMEOUT_S` and :data:`WEIGHT_SYNC_TIMEOUT_S`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from .failures import ConfigError

DEACTIVATE_WAIT_TIMEOUT_S = 600.0
"""Longest the trainer waits for ``deactivate_wait_samples`` before releasing anyway (controller and job).
verl's wait has no bound at all (known weakness 3); ten minutes covers the rollout phase of one sync cycle
of large models while bounding how long a stalled rollouter keeps trainer GPUs from training."""

WEIGHT_SYNC_TIMEOUT_S = 300.0
"""Deadline of one weight broadcast (controller and job): tens of GB over the network can take minutes."""

HONOURED_BY: dict[str, str] = {
    "staleness_threshold": "controller and trainer agent",
    "trigger_parameter_sync_step": "controller and trainer agent",
    "require_batches": "controller and trainer agent",
    "partial_rollout": "trainer agent",
    "concurrent_samples_per_replica": "trainer agent",
    "max_queue_size": "trainer agent",
    "use_dynamic_resource_scheduling": "controller",
    "dynamic_schedule_policy": "controller",
    "dynamic_schedule_deactivate_ratio": "controller",
    "dynamic_schedule_enable_rebalance": "controller",
}
"""verl's keys rollmesh acts on, and which server acts on each (``rollmesh train`` passes them along)."""

NO_EFFECT: dict[str, str] = {
    "use_trainer_do_validate": "rollmesh runs no validation on the trainer's GPUs",
    "parallel_validate_and_rollout": "rollmesh runs no validation pass",
    "use_rollout_log_probs": "the trainer always uses the rollout log-probs",
    "compute_prox_log_prob": "the trainer's GRPO loss has no proximal log-prob term",
    "checkpoint_engine": "weights move through rollmesh's weight broadcast (weight_sync_backend)",
}
"""verl's keys with no effect in rollmesh, and why."""


MULTI_TURN_NO_EFFECT: dict[str, str] = {
    "use_inference_chat_template": "rollmesh renders only the new messages of each turn with the model's template",
    "tokenization_sanity_check_mode": "rollmesh never re-tokenizes earlier turns: each turn's ids are kept as "
                                      "generated",
    "num_repeat_rollouts": "the group size is actor_rollout_ref.rollout.n",
    "interaction_config_path": "verl's interactions are not supported; give multi_turn.environment (an "
                               "Environment class) for user turns",
    "function_tool_path": "function tools are not supported; declare tools in tool_config_path (BaseTool "
                          "classes)",
    "completion_callback": "rollmesh's tool agent loop is built in",
}
"""verl's ``actor_rollout_ref.rollout.multi_turn`` keys with no effect in rollmesh, and why."""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def split_async_training(data: Mapping[str, Any], prefix: str, fields: Iterable[str], *,
                         honoured_by: Mapping[str, str] = HONOURED_BY, no_effect_keys: Mapping[str, str] = NO_EFFECT,
                         section: str = "async_training") -> tuple[dict[str, Any], list[str]]:
    """``(the keys this section parses, one note line or none)``.

    ``fields`` are the section's own keys (verl's keys it acts on and its
    rollmesh-only ones); they are kept. Other verl keys are dropped with a
    note; an unknown key close to a known one raises ``ConfigError`` with a
    suggestion; other unknown keys are dropped with a note.
    """

    own = set(fields)
    known = own | set(honoured_by) | set(no_effect_keys)
    kept: dict[str, Any] = {}
    elsewhere: list[str] = []
    no_effect: list[str] = []
    unknown: list[str] = []
    for key, value in data.items():
        name = str(key)
        if name in own:
            kept[name] = value
        elif name in honoured_by:
            elsewhere.append(f"{name} (the {honoured_by[name]})")
        elif name in no_effect_keys:
            no_effect.append(name)
        else:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)
            if close:
                raise ConfigError(_join(prefix, name), f"unknown key (did you mean '{_join(prefix, close[0])}'?)")
            unknown.append(name)
    parts = []
    if no_effect:
        parts.append("accepted, no effect in rollmesh: " + ", ".join(
            f"{k} ({no_effect_keys[k]})" for k in no_effect))
    if elsewhere:
        parts.append("accepted, acted on by another server: " + ", ".join(elsewhere))
    if unknown:
        parts.append("accepted, not a key rollmesh knows (ignored): " + ", ".join(unknown))
    notes = [f"{prefix or section}: " + "; ".join(parts)] if parts else []
    return kept, notes
