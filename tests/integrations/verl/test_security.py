"""The verl plugin on a secure mesh (mutual TLS, roles, signed weight manifests): another CA's certificate,
plaintext, or a role that may not commit weights are refused with errors that say so. verl generating and
committing versions with a trainer-agent certificate of the mesh's CA is the example's run
(``test_example.py``: ``rollmesh up`` makes a secure mesh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import verl_config
from .fleet import Fleet, fleet

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from launcher.pki import LocalPki

    tmp = tmp_path_factory.mktemp("secure")
    pki = LocalPki(tmp / "pki")
    with fleet(tmp / "fleet", agents=1, pki=pki) as f:
        yield f, pki


def _manager(config: Any) -> Any:
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager

    return FullyAsyncLLMServerManager.create(config=config, worker_group=None)


def _checkpoints(f: Fleet, config: Any, manager: Any, tls: dict[str, str]) -> Any:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    from .trainer_worker import CpuTrainerWorker

    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    trainer = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(CpuTrainerWorker), model_path=f.model, engine_kwargs=f.engine_kwargs(tls=tls)), use_gpu=False)
    return trainer, CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine), actor_wg=trainer,
        replicas=manager.get_replicas())


def test_a_certificate_of_another_ca_is_refused(secure, tmp_path: Path):
    from launcher.pki import LocalPki
    from rollmesh_verl.checks import FleetCheckFailed

    f, _ = secure
    stranger = LocalPki(tmp_path / "other-ca", ca_name="another CA").section("trainer-agent", "verl")
    with pytest.raises(FleetCheckFailed, match="did not answer .*mutual TLS"):
        _manager(verl_config(f, replicas=1, tls=stranger, call_timeout_s=5))


def test_plaintext_against_a_secure_mesh_is_refused(secure):
    from rollmesh_verl.checks import FleetCheckFailed

    f, _ = secure
    with pytest.raises(FleetCheckFailed, match="did not answer .*mutual TLS"):
        _manager(verl_config(f, replicas=1, call_timeout_s=5))


def test_a_role_that_may_not_commit_weights_fails_the_update_naming_it(secure):
    f, pki = secure
    tls = pki.section("client", "verl-client")   # may generate, may not commit weight versions
    config = verl_config(f, replicas=1, tls=tls)
    manager = _manager(config)
    _, checkpoints = _checkpoints(f, config, manager, tls)
    with pytest.raises(Exception, match="SyncWeights of version 7 .*PERMISSION_DENIED"):
        checkpoints.update_weights(global_steps=7)
