"""verl's trainer on CPU, for trying the verl example on a machine without an accelerator (opt-in).

Load it beside the plugin, ``VERL_USE_EXTERNAL_MODULES=rollmesh_verl.cpu`` (``import verl`` then loads it in
every process of the run, Ray workers included), and give Ray logical GPUs for verl's resource pools
(``+ray_kwargs.ray_init.num_gpus=N``, N = the trainer's ranks; verl counts trainer ranks as GPUs). It does three
things, the first two through verl's extension points:

1. registers a ``cpu`` platform in verl's ``PlatformRegistry``: torch's CPU device, gloo collectives, no device
   memory to manage. verl picks it when ``VERL_PLATFORM=cpu`` or when it finds no accelerator (verl probes the
   registered platforms in order, CUDA first, so a GPU machine keeps CUDA);
2. registers verl's FSDP language-model engine for the ``cpu`` device in ``EngineRegistry`` (verl registers it
   for ``cuda`` and ``npu`` only, ``verl/workers/engine/fsdp/transformer_impl.py``, line 1143 in verl 0.9.1);
3. changes one default no extension point reaches: verl's workers build their process group with
   ``backend = f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`` (``verl/utils/distributed.py``, line 89),
   which on CPU reads ``cpu:gloo,cpu:gloo`` and torch refuses ("Duplicate device type cpu"). On this platform,
   and only when the caller names no backend, the group is built with ``cpu:gloo``. verl's source is not edited:
   :func:`verl.utils.distributed.initialize_global_process_group_ray` is wrapped when this module loads, before
   verl's workers import it.

Slow (a CPU), for small models; not for production training.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM = "cpu"


class _CpuDeviceModule(types.ModuleType):
    """What verl calls on ``torch.<device>``, for the CPU: ``torch.cpu`` where it has the call, else the answer
    of a device with no memory of its own to count or free."""

    def __init__(self) -> None:
        super().__init__("rollmesh_verl.cpu.device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def set_device(device: Any) -> None:
        """One CPU device: nothing to select."""

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU work is synchronous."""

    @staticmethod
    def empty_cache() -> None:
        """No device cache."""

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        """No device memory to count."""

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import os  # noqa: PLC0415

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return free, total


_DEVICE = _CpuDeviceModule()


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """torch's CPU device under verl (see the module docstring)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        # verl passes this to .to() and torch.device(); an int would name an accelerator
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """One CPU device: nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """No device allocator."""

    def empty_cache(self) -> None:
        """No device cache."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"   # set by Ray for its logical GPUs; nothing reads it on CPU

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def get_device_uuid(self, device_id: Any) -> str:
        return "cpu"

    def ray_resource_name(self) -> str:
        return "GPU"   # verl's pool check counts GPUs: Ray's logical ones (ray_init.num_gpus)

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    def cudart(self) -> Any:
        return None


def _register_engine() -> None:
    from verl.workers.engine.base import EngineRegistry  # noqa: PLC0415
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: PLC0415

    registered = getattr(EngineRegistry, "_engines", {}).get("language_model", {})
    backends = [b for b in ("fsdp", "fsdp2") if PLATFORM not in registered.get(b, {})]   # a verl that has one
    if backends:
        EngineRegistry.register(model_type="language_model", backend=backends, device=[PLATFORM])(
            FSDPEngineWithLMHead)


def _gloo_process_group() -> None:
    import verl.utils.distributed as distributed  # noqa: PLC0415
    from verl.utils.device import get_device_name  # noqa: PLC0415

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "rollmesh_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second: int | None = None, backend: str | None = None) -> Any:
        if backend is None and get_device_name() == "cpu":
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray.rollmesh_cpu = True   # type: ignore[attr-defined]
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
    workers = sys.modules.get("verl.workers.engine_workers")   # imported it by name already: patch its copy too
    if workers is not None:
        workers.initialize_global_process_group_ray = initialize_global_process_group_ray   # type: ignore[attr-defined]


_gloo_process_group()
_register_engine()
