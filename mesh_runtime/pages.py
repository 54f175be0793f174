"""Pages of listings (AIP-158), for every server: bounded responses, opaque tokens, an event loop kept free.

A token names the last id of the previous page and a fingerprint of the
request's filters, so a page is never read with other filters than its first.
Building a long listing yields to the event loop every :data:`YIELD_EVERY`
records, so lease renewals and other RPCs are served while it runs.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from mesh_runtime.errors import InvalidArgument
from mesh_runtime.reasons import Reason

MAX_PAGE_SIZE = 1000
YIELD_EVERY = 256
T = TypeVar("T")


def _fingerprint(filters: Any) -> str:
    return hashlib.sha256(repr(filters).encode()).hexdigest()[:12]


def page(items: Sequence[T], *, key: Callable[[T], str], page_size: int, page_token: str,
         filters: Any) -> tuple[list[T], str]:
    """The page asked for of ``items`` (sorted by ``key``, their id) and the next page's token ('' after
    the last)."""
    if page_size < 0:
        raise InvalidArgument(f"page_size must be >= 0, got {page_size}", reason=Reason.INVALID_PAGE_SIZE)
    start = 0
    if page_token:
        try:
            version, fingerprint, after = base64.urlsafe_b64decode(page_token.encode()).decode().split("|", 2)
        except (ValueError, UnicodeDecodeError):
            raise InvalidArgument(f"page_token {page_token[:40]!r} is not one this server gave out",
                                  reason=Reason.INVALID_PAGE_TOKEN) from None
        if version != "v1" or fingerprint != _fingerprint(filters):
            raise InvalidArgument("page_token belongs to a listing with other filters; start again without it",
                                  reason=Reason.INVALID_PAGE_TOKEN)
        start = bisect.bisect_right(items, after, key=key)
    if page_size == 0:
        return list(items[start:]), ""
    size = min(page_size, MAX_PAGE_SIZE)
    chosen = list(items[start:start + size])
    if start + size >= len(items) or not chosen:
        return chosen, ""
    token = base64.urlsafe_b64encode(f"v1|{_fingerprint(filters)}|{key(chosen[-1])}".encode()).decode()
    return chosen, token


async def convert_all(items: Iterable[T], convert: Callable[[T], Any]) -> list[Any]:
    """``[convert(item) ...]``, yielding to the event loop every :data:`YIELD_EVERY` items."""
    out = []
    for index, item in enumerate(items, 1):
        out.append(convert(item))
        if index % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    return out
