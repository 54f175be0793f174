"""What makes two models the same for rollout: the architecture a ``config.json`` declares and the tokenizer's
vocabulary. Read from a local Hugging Face directory, or from a rollmesh preset name (``tiny-llama``...)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
"""The ``config.json`` fields compared: a model whose weights fit another's shapes and whose tokens mean the same."""


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    architecture: dict[str, Any]
    vocabulary: str   # a digest of the token -> id mapping

    def difference(self, other: ModelIdentity) -> str:
        """Empty when the two are the same model for rollout; else what differs."""
        keys = [k for k in ARCHITECTURE if k in self.architecture and k in other.architecture
                and self.architecture[k] != other.architecture[k]]
        parts = [f"{k} {other.architecture[k]!r} vs verl's {self.architecture[k]!r}" for k in keys]
        if self.vocabulary != other.vocabulary:
            parts.append("the tokenizers' vocabularies differ")
        return "; ".join(parts)


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    config = config.get("text_config") or config
    out = {k: config[k] for k in ARCHITECTURE if k in config}
    out.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    return out


def _vocabulary(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


def model_identity(path: str, tokenizer: Any = None) -> ModelIdentity:
    """The identity of the local Hugging Face directory ``path`` (``tokenizer``: its tokenizer, if loaded)."""
    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    if tokenizer is None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return ModelIdentity(_architecture(config), _vocabulary(tokenizer))


def node_identity(model: str) -> ModelIdentity | None:
    """The identity of a node's ``model`` (a preset name or a directory); None when it cannot be read here."""
    from modeling.presets import PRESETS  # noqa: PLC0415

    if model in PRESETS:
        family, fields = PRESETS[model]
        from modeling.tokenizer import preset_tokenizer  # noqa: PLC0415

        return ModelIdentity(_architecture({"model_type": family, **fields}), _vocabulary(preset_tokenizer()))
    if (Path(model) / "config.json").is_file():
        return model_identity(model)
    return None
