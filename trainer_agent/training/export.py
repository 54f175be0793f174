"""The trained model as a Hugging Face directory: config.json, model.safetensors, the tokenizer.

Written from any weight source by Hugging Face names (the torch backend's
model, or megatron-core's GPT exported through its mapping), so
``transformers.AutoModelForCausalLM.from_pretrained`` loads it and a replica
agent serves it as is (``model: DIR``). The config is the checkpoint's own
(``config.json`` of a model directory) or the preset's; tied weights are
written once, as the checkpoint does. The directory is written next to its
final place and renamed into it, so a reader never sees half a model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from modeling.model_names import is_model_directory

if TYPE_CHECKING:
    from ..weight_source import WeightSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _config(model: str) -> dict:
    if is_model_directory(model):
        return json.loads((Path(model) / "config.json").read_text())
    from modeling.presets import preset_config

    return preset_config(model).to_dict()


def export_model(source: WeightSource, directory: str | Path) -> Path:
    """Write ``source``'s current weights (a loaded :class:`~trainer_agent.weight_source.WeightSource`) as a
    Hugging Face model directory at ``directory`` (replaced if it exists); returns it."""
    from safetensors.torch import save_file

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        snapshot = source.snapshot()
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in snapshot.tensors}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = _config(source.model)
        config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if is_model_directory(source.model):
            for name in TOKENIZER_FILES:
                if (Path(source.model) / name).is_file():
                    shutil.copy2(Path(source.model) / name, staging / name)
        else:
            from modeling.tokenizer import save_preset_tokenizer

            save_preset_tokenizer(staging)
        (staging / "rollmesh.json").write_text(json.dumps({"weight_version": snapshot.weight_version,
                                                           "trained_from": source.model}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target

