"""A small character-level tokenizer for the random presets, so text prompts and chat templates work on them.

The presets' 256-token vocabulary is laid out as:

- ``0`` ``<pad>``, ``1`` ``</s>`` (EOS, also the copy task's answer end), ``2`` ``<sep>``, ``3`` ``<unk>``,
  ``4`` ``<s>``, ``5`` ``<|system|>``, ``6`` ``<|user|>``, ``7`` ``<|assistant|>`` (special tokens);
- tab, newline and printable ASCII at their code points (``"A"`` is 65);
- every other id an unused ``<extra_N>`` token.

The chat template renders ``<|role|>content</s>`` per message and, with
``add_generation_prompt``, ends with ``<|assistant|>``. It is built with the
``tokenizers`` library and saved in the Hugging Face format
(``tokenizer.json`` + ``tokenizer_config.json``) next to a saved preset, so
``AutoTokenizer.from_pretrained`` loads it like any other.
"""

from __future__ import annotations

import functools
from pathlib import Path

VOCAB_SIZE = 256
SPECIALS = ("<pad>", "</s>", "<sep>", "<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _vocab() -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for code in (9, 10, *range(32, 127)):
        vocab[chr(code)] = code
    for i in range(VOCAB_SIZE):
        if i not in vocab.values():
            vocab[f"<extra_{i}>"] = i
    return vocab


@functools.cache
def preset_tokenizer():
    """The presets' tokenizer (a ``transformers`` fast tokenizer; built once per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _vocab()
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", bos_token="<s>", sep_token="<sep>",
                                        additional_special_tokens=list(SPECIALS[5:]))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_preset_tokenizer(directory: str | Path) -> None:
    preset_tokenizer().save_pretrained(str(directory))


def load_tokenizer(model: str):
    """The tokenizer of a local Hugging Face directory, or the presets' for a preset name."""
    if "/" in model or model.startswith("."):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    return preset_tokenizer()
