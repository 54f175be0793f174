"""Counter-based seeding: the random draw for completion token ``i`` of a
request depends only on ``(seed, i)``.

This is what makes seeded sampling resumable: an engine that continues a
request from a resumed prefix of ``n`` tokens draws exactly the numbers the
original engine would have drawn for tokens ``n, n+1, ...``. Pure Python, so
the synthetic engine can use it without importing torch.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One round of the SplitMix64 finaliser (a well-mixed 64-bit hash)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, index: int) -> int:
    """A 64-bit seed for draw ``index`` of the stream seeded with ``seed``."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (index & _MASK64))


def uniform(seed: int, index: int) -> float:
    """A float in [0, 1) determined by ``(seed, index)``."""
    return (mix_seed(seed, index) >> 11) * (1.0 / (1 << 53))
