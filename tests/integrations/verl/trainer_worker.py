"""The trainer side of the weight tests: a verl ``Worker`` that does what verl's engine workers do in
``update_weights`` with a non-naive backend (build the checkpoint engine from the registry, ``is_master`` on rank 0,
hand it the model's per-tensor parameters by Hugging Face name), over a Hugging Face model on CPU.

verl's own actor workers need FSDP or Megatron on CUDA; this worker is the test's trainer, not a copy of them: it
holds a model, moves its weights, and sends them through verl's checkpoint-engine seam exactly as they do.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register


class CpuTrainerWorker(Worker):
    def __init__(self, model_path: str, engine_kwargs: dict[str, Any]) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        import rollmesh_verl  # noqa: F401 - the plugin, as verl's entry point loads it in every process

        self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True).eval()
        self.checkpoint_engine = CheckpointEngineRegistry.new("rollmesh", is_master=self.rank == 0,
                                                              bucket_size=1 << 20, **engine_kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_a_step(self, seed: int, only: str = "") -> None:
        """Move every weight (or the one named ``only``), the same way on every rank (a stand-in for an optimizer
        step)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.model.named_parameters()):
                if not only or name == only:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.05)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self.model.state_dict().items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        weights = ((name, tensor) for name, tensor in self.model.state_dict().items())
        return await self.checkpoint_engine.send_weights(weights, global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)
