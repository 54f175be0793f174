"""``WeightSpec``: one weight tensor as both ends of a broadcast describe it (no torch needed)."""

from __future__ import annotations

from typing import NamedTuple


class WeightSpec(NamedTuple):
    """Name (Hugging Face naming), dtype name (``"float32"``, ``"bfloat16"``...)
    and shape of one weight tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
