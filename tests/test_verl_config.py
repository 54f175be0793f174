"""verl's async_training block is accepted as is by the job, the controller and the trainer agent."""

from __future__ import annotations

import dataclasses
import io

import pytest
import yaml

from controller.config import ControllerConfig
from controller.core.config import SchedulingConfig
from launcher.cli import print_config_notes
from mesh_runtime.config import ConfigError, config_notes, load_config
from launcher.job_config import JobAsyncTraining, load_job_config
from tests.verl_shaped import VERL_ASYNC_TRAINING, VERL_ASYNC_TRAINING_EXTRA
from trainer_agent.config import TrainerAgentConfig
from trainer_agent.driver.settings import AsyncTrainingSettings

pytestmark = pytest.mark.timeout(30)

FULL_BLOCK = {**VERL_ASYNC_TRAINING, **VERL_ASYNC_TRAINING_EXTRA}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_job_config_accepts_verls_block_and_reports_what_has_no_effect(tmp_path):
    job = load_job_config(write(tmp_path, "job.yaml", {"async_training": FULL_BLOCK}))
    at = job.async_training
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches) == (0.1, 4, 1)
    assert at.partial_rollout is True and at.concurrent_samples_per_replica == 16
    assert at.dynamic_schedule_deactivate_ratio == 0.3 and at.dynamic_schedule_enable_rebalance is True
    notes = config_notes(job)
    assert len(notes) == 1 and notes[0].startswith("async_training: accepted, no effect in rollmesh: ")
    for key in ("use_trainer_do_validate", "parallel_validate_and_rollout", "use_rollout_log_probs",
                "compute_prox_log_prob", "checkpoint_engine"):
        assert key in notes[0]
    assert "staleness_threshold" not in notes[0]                 # honoured: not reported


def test_the_controller_config_accepts_verls_block(tmp_path):
    cfg = load_config(ControllerConfig, write(tmp_path, "c.yaml", {"async_training": FULL_BLOCK}))
    assert cfg.async_training.dynamic_schedule_policy == "default"
    (note,) = config_notes(cfg)
    assert "no effect in rollmesh: " in note and "use_trainer_do_validate (rollmesh runs no validation" in note
    assert "acted on by another server: " in note and "partial_rollout (the trainer agent)" in note
    assert "concurrent_samples_per_replica (the trainer agent)" in note


def test_the_trainer_agent_config_accepts_verls_block(tmp_path):
    cfg = load_config(TrainerAgentConfig, write(tmp_path, "t.yaml", {"async_training": FULL_BLOCK}))
    assert cfg.async_training.partial_rollout is True
    (note,) = config_notes(cfg)
    for key in ("use_dynamic_resource_scheduling", "dynamic_schedule_policy", "dynamic_schedule_deactivate_ratio",
                "dynamic_schedule_enable_rebalance"):
        assert f"{key} (the controller)" in note
    assert "use_trainer_do_validate" in note


def test_keys_of_other_verl_versions_are_accepted_and_typos_are_not(tmp_path):
    job = load_job_config(write(tmp_path, "a.yaml", {"async_training": {"replay_buffer": {"enable": False}}}))
    assert "not a key rollmesh knows (ignored): replay_buffer" in config_notes(job)[0]
    with pytest.raises(ConfigError, match=r"async_training.staleness_treshold': unknown key \(did you mean "
                                          r"'async_training.staleness_threshold'\?\)"):
        load_job_config(write(tmp_path, "b.yaml", {"async_training": {"staleness_treshold": 0.2}}))
    with pytest.raises(ConfigError, match="did you mean 'async_training.partial_rollout'"):
        load_config(ControllerConfig, write(tmp_path, "c.yaml", {"async_training": {"partial_rolout": True}}))
    # verl's keys are still type-checked where rollmesh acts on them
    with pytest.raises(ConfigError, match="async_training.staleness_threshold"):
        load_job_config(write(tmp_path, "d.yaml", {"async_training": {"staleness_threshold": "lots"}}))


def test_one_default_per_key_across_sections():
    job, core, trainer = JobAsyncTraining(), SchedulingConfig(), AsyncTrainingSettings()
    for section in (job, core, trainer):
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in VERL_ASYNC_TRAINING.items():
            if key in names:
                assert getattr(section, key) == value, (type(section).__name__, key)
    for key in ("deactivate_wait_timeout_s", "weight_sync_timeout_s", "sleep_level"):
        assert getattr(job, key) == getattr(core, key), key
    for key in ("partial_rollout", "max_queue_size", "concurrent_samples_per_replica"):
        assert getattr(job, key) == getattr(trainer, key), key


def test_notes_are_printed_at_start():
    out = io.StringIO()
    job_cfg = JobAsyncTraining()
    object.__setattr__(job_cfg, "_config_notes", ["async_training: accepted, no effect in rollmesh: x (why)"])
    print_config_notes("controller", job_cfg, out)
    assert out.getvalue() == "rollmesh controller: async_training: accepted, no effect in rollmesh: x (why)\n"
