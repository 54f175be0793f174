"""Incremental detokenization: the text of a growing completion, in time linear in its length.

Decoding the whole completion again for every streamed chunk costs O(n) per chunk and O(n^2) per
completion. :class:`IncrementalDecoder` instead decodes, for each new batch of tokens, only the tokens since
its last emitted text plus those new ones, and keeps the difference between the two decodes: decoding a
short window with its left context is what keeps byte-level BPE (a character split over tokens) and
SentencePiece-style decoders (a token's leading space that only shows after another token) right. While the
newest tokens end inside a character (the decode ends in U+FFFD), their text waits for the next token.

The same technique serves vLLM's and Hugging Face TGI's detokenizers; :attr:`text` equals a full decode of
:attr:`ids` (without a character still being decoded) for the tokenizers rollmesh serves, which the tests
check on byte-level and SentencePiece-style tokenizers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decodes(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """The text of ``ids`` as they arrive; see the module docstring."""

    def __init__(self, tokenizer: Decodes, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        """The text of ``ids[:read]``: every complete character so far."""
        self._prefix = 0
        """Start of the left context decoded again with new tokens (where the last emitted text began)."""
        self._read = 0
        """Tokens whose text is in :attr:`text`."""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def extend(self, ids: Iterable[int]) -> str:
        """Add tokens; the text they complete (empty while they end inside a character)."""
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return ""
        context = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix)
        if window == context:   # tokens with no text (skipped specials): consumed, the context stays
            self._read = len(self.ids)
            return ""
        if len(window) < len(context) or window.endswith(REPLACEMENT):
            return ""
        new = window[len(context):]
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def pending(self) -> str:
        """The text of tokens still waiting for the rest of a character (U+FFFD where bytes are missing)."""
        if len(self.ids) == self._read:
            return ""
        return self._decode(self._prefix)[len(self._decode(self._prefix, self._read)):]
