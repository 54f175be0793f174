"""``rollmesh_verl.cpu``: verl's trainer on CPU through verl's platform and engine registries, and the one default
no extension point reaches (the process group's backend string). Each check runs in a fresh process, as verl's
Ray workers load the module through ``VERL_USE_EXTERNAL_MODULES``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mesh_runtime.net import free_port

from .fleet import ROOT

PROBE = """
import json, os
import verl   # loads the modules named in VERL_USE_EXTERNAL_MODULES
import torch.distributed as dist
from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device, get_device_id
from verl.workers.engine.base import EngineRegistry
from verl.workers import engine_workers
engine_workers.initialize_global_process_group_ray()   # what verl's trainer workers call
print(json.dumps({
    "device": get_device_name(), "backend": get_nccl_backend(), "device_id": str(get_device_id()),
    "device_name": get_torch_device().get_device_name(), "memory": get_torch_device().memory_allocated(),
    "engines": sorted(k for k in EngineRegistry._engines["language_model"]["fsdp2"] if isinstance(k, str)),
    "group": dist.get_backend(), "world": dist.get_world_size()}))
"""


def _probe(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
                               "GLOO_SOCKET_IFNAME": "lo", **env})


def test_verl_picks_the_cpu_platform_and_builds_its_process_group_with_gloo():
    done = _probe(VERL_USE_EXTERNAL_MODULES="rollmesh_verl.cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["device"] == "cpu" and seen["backend"] == "gloo" and seen["device_id"] == "cpu"
    assert seen["device_name"] == "cpu" and seen["memory"] == 0
    assert "cpu" in seen["engines"] and "cuda" in seen["engines"]
    assert seen["group"] == "cpu:gloo" and seen["world"] == 1


def test_verls_own_default_on_cpu_is_a_backend_string_torch_refuses():
    """What the module's third change is for: verl's ``cpu:gloo,{device}:{backend}`` reads ``cpu:gloo,cpu:gloo``
    on CPU, which torch refuses; if a torch ever accepts it, the wrapper is no longer needed."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        dist.distributed_c10d.BackendConfig(dist.Backend("cpu:gloo,cpu:gloo"))
