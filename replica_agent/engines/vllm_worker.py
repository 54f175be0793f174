"""Methods rollmesh adds to every vLLM GPU worker.

vLLM mixes the class named by the ``worker_extension_cls`` engine argument
into its worker class, and ``collective_rpc(method_name, ...)`` on the async
engine runs the named method on every worker (one per tensor-parallel rank)
and returns their results as a list. This is the weight-update route vLLM's
RLHF examples document (``examples/offline_inference/rlhf_utils.py``: a
``WorkerExtension`` whose methods call ``self.model_runner.model.load_weights``).

This module is imported inside vLLM's worker processes, so it must stay
importable on its own and cheap: torch is imported inside the methods.
"""

from __future__ import annotations

from typing import Any

LOAD_WEIGHTS = "rollmesh_load_weights"
"""Name to pass to ``collective_rpc`` to load a bucket of Hugging Face-named tensors."""
DEVICE_MEMORY_USED = "rollmesh_device_memory_used"
"""Name to pass to ``collective_rpc`` to read each worker's used device memory in bytes."""

EXTENSION_CLASS = f"{__name__}.RollmeshWorkerExtension"
"""Fully qualified name for the ``worker_extension_cls`` engine argument."""


class RollmeshWorkerExtension:
    """Mixed into vLLM's worker: ``self.model_runner`` and ``self.device`` are the worker's."""

    model_runner: Any
    device: Any

    def rollmesh_load_weights(self, weights: list[Any], reload: bool = False) -> int:
        """Load ``[(hf_name, tensor), ...]`` into the served model.

        The model's own ``load_weights`` maps Hugging Face names onto vLLM's
        fused parameters and takes this rank's shard, copying into the
        existing parameter storage (so captured CUDA graphs stay valid).
        A quantized model (``reload``) cannot take checkpoint-format tensors
        that way: its parameters were processed after loading (repacked,
        scaled), so the model runner's ``reload_weights`` restores them to
        the checkpoint layout, loads, and processes them again. Pairs arrive
        as 2-item lists after vLLM's msgpack serialisation. Returns the
        number of tensors received.
        """
        pairs = [(str(name), tensor) for name, tensor in weights]
        if reload:
            runner_reload = getattr(self.model_runner, "reload_weights", None)
            if runner_reload is None:
                raise RuntimeError("this vLLM's model runner has no reload_weights; quantized models cannot "
                                   "take weight updates in place")
            runner_reload(weights_iterator=iter(pairs))
        else:
            self.model_runner.model.load_weights(weights=pairs)
        return len(pairs)

    def rollmesh_device_memory_used(self) -> int:
        """Bytes in use on this worker's device (by every process on it)."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free)
