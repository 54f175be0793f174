"""Keys of a token sequence's leading blocks, shared by the engines' prefix caches and the balancer's prefix index.

Block ``i`` of a sequence (tokens ``[i*size, (i+1)*size)``) is keyed by a hash chained over every block before
it, so equal keys mean equal prefixes (up to hash collisions, which only cost a cache miss or a worse route,
never a wrong token: engines that reuse KV compare tokens). Only full blocks have keys. The key is Python's
``hash`` of ``(parent key, block tokens)``: for integers it is the same in every process and on every run
(string hashing is randomized, integer hashing is not), so a replica and a balancer compute the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence


def block_keys(tokens: Sequence[int], size: int, limit: int | None = None) -> list[int]:
    """Keys of the full ``size``-token blocks at the start of ``tokens`` (at most ``limit`` of them)."""
    count = len(tokens) // size
    if limit is not None:
        count = min(count, limit)
    keys: list[int] = []
    parent = 0
    for start in range(0, count * size, size):
        parent = hash((parent, tuple(tokens[start:start + size])))
        keys.append(parent)
    return keys
