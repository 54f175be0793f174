"""A small character-level tokenizer for the random presets, so text prompts and chat templates work on them.

The presets' 256-token vocabulary is laid out as:

- ``0`` ``<pad>``, ``1`` ``</s>`` (EOS, also the copy task's answer end), ``2`` ``<sep>``, ``3`` ``<unk>``,
  ``4`` ``<s>``, ``5`` ``<|system|>``, ``6`` ``<|user|>``, ``7`` ``<|assistant|>`` (special tokens);
- tab, newline and printable ASCII at their code points (``"A"`` is 65);
- every other id an unused ``<extra_N>`` token.

The chat template (:data:`mesh_runtime.chat.CHAT_TEMPLATE`, shared with the torch-free balancer) renders
``<|role|>content</s>`` per message (tools and tool calls in the Hermes layout) and, with
``add_generation_prompt``, ends with ``<|assistant|>``. It is built with the
``tokenizers`` library and saved in the Hugging Face format
(``tokenizer.json`` + ``tokenizer_config.json``) next to a saved preset, so
``AutoTokenizer.from_pretrained`` loads it like any other.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from mesh_runtime.chat import CHAT_TEMPLATE, SPECIALS, VOCAB_SIZE, build_preset_core

from .model_names import is_model_directory

if TYPE_CHECKING:   # transformers loads only when a tokenizer is built
    from transformers import PreTrainedTokenizerBase

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "VOCAB_SIZE", "load_tokenizer", "preset_tokenizer", "save_preset_tokenizer"]


@functools.cache
def preset_tokenizer() -> PreTrainedTokenizerBase:
    """The presets' tokenizer (a ``transformers`` fast tokenizer; built once per process)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_preset_core(with_specials=False), pad_token="<pad>",
                                        eos_token="</s>", unk_token="<unk>", bos_token="<s>", sep_token="<sep>",
                                        additional_special_tokens=list(SPECIALS[5:]))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_preset_tokenizer(directory: str | Path) -> None:
    preset_tokenizer().save_pretrained(str(directory))


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a local Hugging Face directory, or the presets' for a preset name."""
    if is_model_directory(model):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    return preset_tokenizer()
