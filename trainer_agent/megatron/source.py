"""The megatron-core training backend: a ``GPTModel`` built from the Hugging Face config, published by HF names.

:class:`MegatronWeightSource` builds megatron-core's GPT (local layer spec:
plain torch modules, no Transformer Engine or Apex needed) with the
dimensions of the model's Hugging Face config, loads the checkpoint (or the
preset's weights) through :mod:`.mapping`, and serves the replicas the
weights under Hugging Face names through the same
:class:`~trainer_agent.weight_source.WeightSource` seam as the torch backend:
each tensor-parallel shard is gathered over the tensor-parallel group and
split back into the checkpoint's tensors. :class:`MegatronCausalLM` gives the
GRPO trainer the ``model(input_ids=..., attention_mask=...).logits`` call it
makes on a transformers model, so the torch backend's loss, offload and
onload (parameters and optimizer state) apply unchanged.

megatron-core's forward pass needs CUDA (its rotary embedding moves to the
current CUDA device); building, loading, sharding and exporting run anywhere.
The trainer agent is one process, so it trains with ``tensor_parallel_size``
1; the sharding and gathering are written for any size (and tested with two
gloo processes).
"""

from __future__ import annotations

import datetime
import logging
import types
from collections.abc import Iterator, Mapping

import torch

from mesh_runtime.net import free_port
from modeling.model_names import is_model_directory

from ..weight_source import WeightSource
from . import mapping

log = logging.getLogger(__name__)


def initialize_parallel(tensor_parallel_size: int = 1) -> None:
    """megatron-core's parallel state for one process group of this process (a single-process gloo group
    unless ``torch.distributed`` is already initialised, e.g. by torchrun)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def build_gpt(layout: mapping.GptLayout, *, dtype: torch.dtype, device: torch.device,
              tensor_parallel_size: int = 1, seed: int = 0) -> torch.nn.Module:
    """megatron-core's ``GPTModel`` with ``layout``'s dimensions (parallel state must be initialised)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.check_tensor_parallel(tensor_parallel_size)
    if device.type == "cuda":
        # Initialising parameters on the GPU draws from megatron's model-parallel CUDA RNG streams, which
        # exist only once seeded (the values are overwritten by the checkpoint's right after).
        model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_query_groups, kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size, normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel_size, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=device.type == "cpu", bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=layout.vocab_size, max_sequence_length=layout.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=int(layout.rope_theta),
                     share_embeddings_and_output_weights=layout.tied_embeddings, parallel_output=False)
    return model.to(device)


class MegatronCausalLM(torch.nn.Module):
    """A ``GPTModel`` called the way the GRPO trainer calls a transformers causal LM (right-padded batches:
    positions start at 0 in every row and the causal mask alone keeps padding out of real tokens)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> types.SimpleNamespace:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        logits = self.gpt(input_ids, positions, attention_mask=None)
        return types.SimpleNamespace(logits=logits)


def hf_checkpoint(model: str, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a local Hugging Face directory or a built-in preset, by HF names."""
    if is_model_directory(model):
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        config = json.loads((Path(model) / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model).glob("*.safetensors")):
            tensors.update(load_file(file))
        if not tensors:
            raise mapping.MappingError(f"{model[:80]!r} holds no *.safetensors files")
        return config, tensors
    from modeling.presets import build_preset_model, preset_config

    module = build_preset_model(model, seed)
    return preset_config(model).to_dict(), {n: p.detach() for n, p in module.state_dict().items()}


class MegatronWeightSource(WeightSource):
    """megatron-core's GPT, by Hugging Face names (see the module docstring)."""

    backend = "megatron"

    def __init__(self, model: str, *, seed: int = 0, dtype: str = "float32", device: str = "cuda",
                 tensor_parallel_size: int = 1, weight_version: int = 0) -> None:
        super().__init__(model, weight_version, seed=seed, dtype=dtype)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.tensor_parallel_size = tensor_parallel_size
        self.layout: mapping.GptLayout | None = None
        self.module: MegatronCausalLM | None = None
        self._params: dict[str, torch.nn.Parameter] = {}

    def _load(self) -> None:
        config, hf = hf_checkpoint(self.model, self.seed)
        self.layout = mapping.GptLayout.from_hf_config(config)
        initialize_parallel(self.tensor_parallel_size)
        gpt = build_gpt(self.layout, dtype=self.dtype, device=self.device,
                        tensor_parallel_size=self.tensor_parallel_size, seed=self.seed)
        self.module = MegatronCausalLM(gpt)
        self._params = dict(gpt.named_parameters())
        self._write_megatron(mapping.to_megatron(self.layout, hf))

    def _tp(self) -> tuple[int, int, object]:
        from megatron.core import parallel_state

        return (parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_group())

    def _write_megatron(self, whole: Mapping[str, torch.Tensor]) -> None:
        rank, size, _ = self._tp()
        unknown = sorted(set(whole) - set(self._params))
        if unknown:
            raise mapping.MappingError(f"the model has no parameter {unknown[0]!r} "
                                       f"({mapping.hf_name_of(unknown[0])})")
        with torch.no_grad():
            for name, tensor in whole.items():
                part = mapping.shard(name, tensor, rank, size)
                param = self._params[name]
                if tuple(part.shape) != tuple(param.shape):
                    raise mapping.MappingError(f"{mapping.hf_name_of(name)}: shard {tuple(part.shape)} does not "
                                               f"fit {name} {tuple(param.shape)}")
                param.copy_(part)

    def _whole(self) -> dict[str, torch.Tensor]:
        """Every megatron tensor, gathered over the tensor-parallel group."""
        import torch.distributed as dist

        rank, size, group = self._tp()
        out = {}
        for name, param in self._params.items():
            data = param.detach()
            if size > 1 and mapping._kind(name) != "replicated":
                parts = [torch.empty_like(data) for _ in range(size)]
                dist.all_gather(parts, data.contiguous(), group=group)
                data = mapping.gather(name, parts)
            out[name] = data
        return out

    @property
    def _loaded_layout(self) -> mapping.GptLayout:
        assert self.layout is not None, "the base class reads and writes only after _load"
        return self.layout

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from mapping.to_hf(self._loaded_layout, self._whole()).items()

    def _write(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        current = dict(self._named_tensors())
        current.update(named_tensors)
        self._write_megatron(mapping.to_megatron(self._loaded_layout, current))

    def _canonical_name(self, name: str) -> str:
        if name == "lm_head.weight" and self.layout is not None and self.layout.tied_embeddings:
            return "model.embed_tokens.weight"
        return name

    def _close(self) -> None:
        self.module = None
        self._params.clear()


