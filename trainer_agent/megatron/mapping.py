"""Hugging Face <-> megatron-core names and layouts of a Llama/Qwen2-family GPT, and tensor-parallel shards.

megatron-core's ``GPTModel`` (local layer spec) names and fuses the weights
differently from a Hugging Face checkpoint:

==========================================  ===========================================================
Hugging Face                                megatron-core
==========================================  ===========================================================
``model.embed_tokens.weight``               ``embedding.word_embeddings.weight`` (vocab-parallel, dim 0)
``model.layers.N.input_layernorm.weight``   ``decoder.layers.N.input_layernorm.weight``
``...self_attn.{q,k,v}_proj.{weight,bias}`` ``decoder.layers.N.self_attention.linear_qkv.{weight,bias}``:
                                            per query group, that group's query heads then its key and
                                            value head, stacked on dim 0 (column-parallel: a rank holds
                                            whole groups)
``...self_attn.o_proj.weight``              ``...self_attention.linear_proj.weight`` (row-parallel, dim 1)
``...post_attention_layernorm.weight``      ``decoder.layers.N.pre_mlp_layernorm.weight``
``...mlp.{gate,up}_proj.weight``            ``decoder.layers.N.mlp.linear_fc1.weight``: gate rows then up
                                            rows (column-parallel: a rank holds its slice of each)
``...mlp.down_proj.weight``                 ``decoder.layers.N.mlp.linear_fc2.weight`` (row-parallel)
``model.norm.weight``                       ``decoder.final_layernorm.weight``
``lm_head.weight``                          ``output_layer.weight`` (absent when tied to the embedding)
==========================================  ===========================================================

Everything here is plain torch, so the mapping is tested on any machine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MG_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_SIMPLE = {  # per-layer HF suffix -> megatron suffix
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}
_COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
           "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


class MappingError(ValueError):
    """A checkpoint or a set of tensors that does not fit the model's layout."""


@dataclasses.dataclass(frozen=True)
class GptLayout:
    """The dimensions of one Llama/Qwen2-family model, from its Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> GptLayout:
        get = (config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type", "")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise MappingError(f"the megatron backend maps Llama-family models (llama, qwen2, mistral), "
                               f"not {str(model_type)[:40]!r}")
        def need(key: str) -> int:
            value = get(key, None)
            if value is None:
                raise MappingError(f"the model's config has no {key}; the megatron backend needs it")
            return int(value)

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        rope = get("rope_theta", None)
        if rope is None:
            rope = (get("rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            num_layers=need("num_hidden_layers"), hidden_size=hidden, num_heads=heads,
            num_query_groups=int(get("num_key_value_heads", None) or heads),
            head_dim=int(get("head_dim", None) or hidden // heads),
            ffn_hidden_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(rope),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=bool(get("attention_bias", model_type == "qwen2")))

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    def check_tensor_parallel(self, size: int) -> None:
        for what, count in (("query groups", self.num_query_groups), ("attention heads", self.num_heads),
                            ("FFN channels", self.ffn_hidden_size), ("vocabulary entries", self.vocab_size)):
            if count % size:
                raise MappingError(f"tensor_parallel_size {size} does not divide the model's {count} {what}")


def _fuse_qkv(layout: GptLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d, per = layout.num_query_groups, layout.head_dim, layout.heads_per_group
    rest = q.shape[1:]
    q = q.reshape(g, per * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *rest)


def _split_qkv(layout: GptLayout, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, per = layout.num_query_groups, layout.head_dim, layout.heads_per_group
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest))


def hf_names(layout: GptLayout) -> list[str]:
    """Every Hugging Face weight name of the model in the order transformers' model lists its parameters (the
    torch backend's broadcast order), the tied ``lm_head`` left out."""
    names = ["model.embed_tokens.weight"]
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        for x in "qkv":
            names += [p + f"self_attn.{x}_proj.weight"] + ([p + f"self_attn.{x}_proj.bias"] if layout.qkv_bias else [])
        names += [p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                  p + "mlp.down_proj.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not layout.tied_embeddings:
        names.append("lm_head.weight")
    return names


def to_megatron(layout: GptLayout, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole (unsharded) megatron tensors from a complete set of Hugging Face ones."""
    missing = [n for n in hf_names(layout) if n not in hf]
    if missing:
        raise MappingError(f"{len(missing)} weight(s) missing from the checkpoint, e.g. {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name, mg in _GLOBAL.items():
        if name in hf and not (name == "lm_head.weight" and layout.tied_embeddings):
            out[mg] = hf[name]
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _SIMPLE.items():
            out[m + mg_suffix] = hf[p + hf_suffix]
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            layout, *(hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"))
        if layout.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                layout, *(hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"))
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    return out


def to_hf(layout: GptLayout, mg: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (views where possible) from whole megatron ones, in checkpoint order."""
    out: dict[str, torch.Tensor] = {}
    reverse = {v: k for k, v in _GLOBAL.items()}
    for i in range(layout.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(layout, mg[m + "self_attention.linear_qkv.weight"])
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v})
        if layout.qkv_bias:
            q, k, v = _split_qkv(layout, mg[m + "self_attention.linear_qkv.bias"])
            out.update({p + "self_attn.q_proj.bias": q, p + "self_attn.k_proj.bias": k,
                        p + "self_attn.v_proj.bias": v})
        for hf_suffix, mg_suffix in _SIMPLE.items():
            out[p + hf_suffix] = mg[m + mg_suffix]
        gate, up = torch.chunk(mg[m + "mlp.linear_fc1.weight"], 2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
    for mg_name, hf_name in reverse.items():
        if mg_name in mg:
            out[hf_name] = mg[mg_name]
    return {name: out[name] for name in hf_names(layout)}


def _kind(name: str) -> str:
    suffix = _MG_LAYER.sub(r"\2", name)
    if suffix in _COLUMN or name in _COLUMN:
        return "column"
    if suffix in _ROW:
        return "row"
    return "replicated"


def shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a whole megatron tensor under tensor parallelism of ``size``."""
    kind = _kind(name)
    if size == 1 or kind == "replicated":
        return tensor
    if name.endswith("mlp.linear_fc1.weight"):   # gate and up are split separately, then stacked
        gate, up = torch.chunk(tensor, 2)
        return torch.cat([torch.chunk(gate, size)[rank], torch.chunk(up, size)[rank]])
    return torch.chunk(tensor, size, dim=0 if kind == "column" else 1)[rank].contiguous()


def gather(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole megatron tensor from every rank's shard, in rank order (the inverse of :func:`shard`)."""
    kind, size = _kind(name), len(shards)
    if size == 1 or kind == "replicated":
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [torch.chunk(s, 2) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(list(shards), dim=0 if kind == "column" else 1)


def hf_name_of(mg_name: str) -> str:
    """The Hugging Face weight (or fused family) a megatron name holds, for messages."""
    for hf, mg in _GLOBAL.items():
        if mg == mg_name:
            return hf
    match = _MG_LAYER.fullmatch(mg_name)
    return f"model.layers.{match.group(1)}.*" if match else mg_name
