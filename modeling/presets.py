"""Tiny, randomly initialised Hugging Face models for tests and benchmarks.

A preset plus a seed fully determines the weights: every replica built from
the same pair holds identical tensors, so greedy outputs agree across
replicas and a request can be resumed on another one. Nothing is downloaded.

``initializer_range`` is larger than the usual 0.02 so the random model has
peaked next-token distributions; with near-uniform logits greedy decoding
would hinge on float rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:   # transformers loads only when a model is built
    from transformers import PretrainedConfig

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", dict(_COMMON, tie_word_embeddings=False)),
    "tiny-qwen2": ("qwen2", dict(_COMMON, tie_word_embeddings=True)),
    # Larger variant for benchmarks and memory tests (~4.5 M parameters).
    "small-llama": (
        "llama",
        dict(_COMMON, vocab_size=4096, hidden_size=256, intermediate_size=688,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=2048, tie_word_embeddings=False),
    ),
    # Larger again, for benchmarks where fixed costs must not dominate (~32 M parameters, 126 MB in fp32).
    "medium-llama": (
        "llama",
        dict(_COMMON, vocab_size=8192, hidden_size=512, intermediate_size=1376,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=2048, tie_word_embeddings=False),
    ),
}


def preset_config(name: str) -> PretrainedConfig:
    """The transformers config object of preset ``name``."""
    from transformers import LlamaConfig, Qwen2Config

    try:
        family, kwargs = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}") from None
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return config_class(**kwargs)


def build_preset_model(name: str, seed: int, dtype: torch.dtype = torch.float32,
                       attn_implementation: str = "sdpa") -> Any:   # a PreTrainedModel; its stubs type .to() oddly
    """Build preset ``name`` with weights drawn from ``seed``, leaving the
    global torch RNG untouched."""
    from transformers import AutoModelForCausalLM

    config = preset_config(name)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)


def save_preset(name: str, seed: int, directory: str | Path) -> Path:
    """Write preset ``name``/``seed`` as a Hugging Face directory
    (config.json + model.safetensors + the presets' tokenizer) loadable with ``model_path``."""
    directory = Path(directory)
    build_preset_model(name, seed).save_pretrained(directory)
    from .tokenizer import save_preset_tokenizer

    save_preset_tokenizer(directory)   # so text prompts and chat templates work on the saved preset too
    return directory
