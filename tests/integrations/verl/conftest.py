"""Fixtures of the verl plugin's tests: real verl 0.9 and Ray from PyPI (``.venv-verl``, ``scripts/test --pins
verl``), a local Ray cluster, a real rollmesh fleet (:mod:`.fleet`), and verl's config composed by hydra from
verl's own ``fully_async_ppo_trainer.yaml`` with the overrides a user writes. Without verl installed (the main
environment) every test here is skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed here: scripts/test --pins verl runs these")
ray = pytest.importorskip("ray")

from .fleet import ROOT, ROLLMESH_PYTHON, Fleet, fleet  # noqa: E402

CONFIG_DIR = str(Path(verl.__file__).parent / "experimental" / "fully_async_policy" / "config")
AGENTIC = ROOT / "examples" / "agentic"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not Path(ROLLMESH_PYTHON).exists():
        skip = pytest.mark.skip(reason=f"{ROLLMESH_PYTHON} is missing: run scripts/install (the fleet runs there)")
        for item in items:
            item.add_marker(skip)


def verl_config(f: Fleet, *overrides: str, model: str | None = None, replicas: int = 2,
                **engine_kwargs: Any) -> Any:
    """verl's fully-async config with the rollmesh overrides for fleet ``f`` (and ``overrides``)."""
    from hydra import compose, initialize_config_dir

    block = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rollmesh"
    kwargs = {}
    for key, value in f.engine_kwargs(**engine_kwargs).items():   # a section ({cert, key, ca}) key by key
        kwargs.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="fully_async_ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model or f.model}",
            "actor_rollout_ref.rollout.name=rollmesh",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=rollmesh",
            *(f"+{block}.{key}={value}" for key, value in kwargs.items()),
            "actor_rollout_ref.rollout.nnodes=1", f"actor_rollout_ref.rollout.n_gpus_per_node={replicas}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.prompt_length=400", "actor_rollout_ref.rollout.response_length=24",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.agent.num_workers=1",
            "data.max_prompt_length=400", "data.max_response_length=24",
            *overrides,
        ])


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    # the example's tool (examples/agentic/lookup_tool.py) imports in verl's agent-loop workers, as a user's would
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(AGENTIC), str(ROOT)])}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def rollmesh_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for the session (2 replica agents): tests that kill an agent start their own, and the weight
    tests, which move its weights, run last (test_weights.py)."""
    with fleet(tmp_path_factory.mktemp("fleet")) as f:
        yield f
