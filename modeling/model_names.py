"""What a model name in a config means: a built-in preset, or a local Hugging Face directory. Imports nothing
heavy, so config validation can use it without torch or transformers."""

from __future__ import annotations


def is_model_directory(model: str) -> bool:
    """Whether ``model`` names a local directory (a '/' in it, or a leading '.') rather than a built-in preset."""
    return "/" in model or model.startswith(".")
