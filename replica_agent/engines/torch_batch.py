"""The running batch of the torch engine: one padded KV cache shared by all rows.

Layout: the cache holds ``[batch, kv_heads, L, head_dim]`` per layer, rows
left-padded to a common length ``L``; ``mask`` (``[batch, L]``) marks real
tokens and ``positions`` holds each row's next position id, so RoPE sees the
same positions a row would see alone. A step:

1. drops retired rows (``index_select`` on the batch dimension) and trims
   leading columns that became padding for every row;
2. decodes one token for every row already in the batch (one forward pass
   with the padding mask and per-row position ids);
3. prefills joining rows, one forward pass per group of equal context
   length and equal cached prefix (so a prefill never contains padding), and
   merges their caches into the batch by left-padding whichever side is
   shorter with zeros. With a :class:`~.torch_prefix.PrefixCache`, a row
   whose context begins with cached tokens prefills only the rest (the
   cached keys and values go in front), rows with the same context in one
   step are prefilled once, every prompt's KV is kept after its prefill and
   every leaving row's whole sequence when it leaves;
4. samples one token per row.

Padding only ever appears as masked key/value columns filled with zeros, so
no query row is ever fully masked and no NaN can leak into the cache.

Not thread-safe: the engine calls it from its single worker thread only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from modeling.versions import cache_keyword

from .request_state import RowSpec, StepBatch
from .sampling import sample_tokens
from .torch_prefix import Entry, PrefixCache


class BatchRunner:
    """Holds the KV cache of the rows in the running batch and steps them."""

    def __init__(self, model: torch.nn.Module, device: torch.device, prefix: PrefixCache | None = None) -> None:
        self.model = model
        self.cache_keyword = cache_keyword(model)   # ``cache`` or ``past_key_values``, by transformers release
        self.device = device
        self.prefix = prefix
        self.ids: list[str] = []
        self.tokens: list[list[int]] = []      # per row: the tokens its cache columns hold
        self.sessions: list[str] = []
        self.generations: list[int] = []       # per row: the prefix cache's generation at its prefill
        self.cached: dict[str, int] = {}        # rows admitted by the last step: context tokens found cached
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.last_tokens: torch.Tensor | None = None

    def reset(self, keep: bool = False, holds: dict[str, float] | None = None) -> None:
        """Forget every row and free the cache; ``keep``: put the rows' sequences into the prefix cache first
        (they finished), held for their sessions as ``holds`` says (request id -> seconds)."""
        if keep and self.prefix is not None and self.ids:
            self._keep_leaving(set(self.ids), holds or {})
        self.ids, self.tokens, self.sessions, self.generations = [], [], [], []
        self.cache = self.mask = self.positions = self.last_tokens = None

    @property
    def cache_length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def step(self, batch: StepBatch) -> list[tuple[int, float]]:
        """Run one step; results follow ``batch.running + batch.admitted``."""
        with torch.no_grad():
            self._drop(batch.dropped, batch.holds)
            running = {r.request_id: r for r in batch.running}
            if set(running) != set(self.ids):
                raise RuntimeError(f"batch out of sync: engine runs {sorted(running)}, cache holds {sorted(self.ids)}")
            rows = [running[rid] for rid in self.ids]  # the cache's row order
            self.cached = {}
            parts = [self._decode()] if rows else []
            for cached, group in self._plan(batch.admitted):
                parts.append(self._prefill(group, cached))
                rows.extend(group)
            results = sample_tokens(torch.cat(parts, dim=0), rows)
            self.last_tokens = torch.tensor([t for t, _ in results], dtype=torch.long, device=self.device)
            by_id = {r.request_id: res for r, res in zip(rows, results)}
            return [by_id[r.request_id] for r in (*batch.running, *batch.admitted)]

    # ------------------------------------------------------------- internals
    def _drop(self, dropped: list[str], holds: dict[str, float]) -> None:
        gone = set(dropped) & set(self.ids)
        if not gone:
            return
        if self.prefix is not None:
            self._keep_leaving(gone, holds)
        keep = [i for i, rid in enumerate(self.ids) if rid not in gone]
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        assert self.cache is not None and self.mask is not None and self.positions is not None \
            and self.last_tokens is not None   # all set together by the first prefill
        self.ids = [self.ids[i] for i in keep]
        self.tokens = [self.tokens[i] for i in keep]
        self.sessions = [self.sessions[i] for i in keep]
        self.generations = [self.generations[i] for i in keep]
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.last_tokens = self.last_tokens.index_select(0, index)
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        layers: Any = self.cache.layers   # full-attention layers: keys, values
        for layer in layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.mask = self.mask[:, start:]

    def _decode(self) -> torch.Tensor:
        assert self.mask is not None and self.positions is not None and self.last_tokens is not None
        ones = torch.ones((len(self.ids), 1), dtype=self.mask.dtype, device=self.device)
        mask = torch.cat([self.mask, ones], dim=1)
        out = self.model(
            input_ids=self.last_tokens[:, None],
            attention_mask=mask,
            position_ids=self.positions[:, None],
            use_cache=True,
            **{self.cache_keyword: self.cache},
        )
        self.mask = mask
        self.positions = self.positions + 1
        for row, token in zip(self.tokens, self.last_tokens.tolist()):
            row.append(token)
        return out.logits[:, -1, :]

    def _plan(self, admitted: list[RowSpec]) -> list[tuple[tuple[Entry, int] | None, list[RowSpec]]]:
        """Groups of joining rows with equal context length and equal cached prefix ``(entry, length)``."""
        groups: dict[tuple[int, int, int], tuple[tuple[Entry, int] | None, list[RowSpec]]] = {}
        for row in admitted:
            entry, length = self.prefix.lookup(row.context) if self.prefix is not None else (None, 0)
            self.cached[row.request_id] = length
            key = (len(row.context), length, id(entry) if entry is not None else 0)
            if key not in groups:
                groups[key] = ((entry, length) if entry is not None else None, [])
            groups[key][1].append(row)
        return list(groups.values())

    def _prefill(self, rows: list[RowSpec], cached: tuple[Entry, int] | None = None) -> torch.Tensor:
        contexts = list(dict.fromkeys(r.context for r in rows))   # each distinct context prefilled once
        start = cached[1] if cached is not None else 0
        input_ids = torch.tensor([list(c[start:]) for c in contexts], dtype=torch.long, device=self.device)
        cache = DynamicCache()
        if cached is not None:
            entry = cached[0]
            for layer_index, (keys, values) in enumerate(zip(entry.keys, entry.values)):
                cache.update(keys[None, :, :start].expand(len(contexts), -1, -1, -1).to(self.device),
                             values[None, :, :start].expand(len(contexts), -1, -1, -1).to(self.device), layer_index)
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache})
        if self.prefix is not None:
            layers = layers_of(cache)
            for u, context in enumerate(contexts):
                self.prefix.insert(context, [layer.keys[u] for layer in layers], [layer.values[u] for layer in layers])
        logits = out.logits[:, -1, :]
        if len(contexts) < len(rows):   # the same context more than once: copy its row
            index = torch.tensor([contexts.index(r.context) for r in rows], dtype=torch.long, device=self.device)
            for row_layer in layers_of(cache):
                row_layer.keys = row_layer.keys.index_select(0, index)
                row_layer.values = row_layer.values.index_select(0, index)
            logits = logits.index_select(0, index)
        n, length = len(rows), len(rows[0].context)
        new_mask = torch.ones((n, length), dtype=torch.long, device=self.device)
        new_positions = torch.full((n,), length, dtype=torch.long, device=self.device)
        placeholder = torch.zeros((n,), dtype=torch.long, device=self.device)
        if self.cache is None:
            self.cache, self.mask, self.positions = cache, new_mask, new_positions
            self.last_tokens = placeholder
        else:
            assert self.positions is not None and self.last_tokens is not None
            self._merge(cache, new_mask)
            self.positions = torch.cat([self.positions, new_positions])
            self.last_tokens = torch.cat([self.last_tokens, placeholder])
        self.ids.extend(r.request_id for r in rows)
        self.tokens.extend(list(r.context) for r in rows)
        self.sessions.extend(r.session_id for r in rows)
        self.generations.extend([self.prefix.generation if self.prefix is not None else 0] * len(rows))
        return logits

    def _keep_leaving(self, gone: set[str], holds: dict[str, float]) -> None:
        """Put the whole sequence of each leaving row into the prefix cache (a session's next turn, a resume
        here, a repeated prompt start with it), held for the session as long as ``holds`` says."""
        assert self.prefix is not None and self.cache is not None and self.mask is not None
        layers: Any = self.cache.layers
        width = self.mask.shape[1]
        for i, rid in enumerate(self.ids):
            if rid in gone:
                held = len(self.tokens[i])
                self.prefix.insert(self.tokens[i], [layer.keys[i, :, width - held:] for layer in layers],
                                   [layer.values[i, :, width - held:] for layer in layers], self.sessions[i],
                                   generation=self.generations[i], hold_s=holds.get(rid, 0.0))

    def _merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        width = max(self.cache_length, mask.shape[1])
        pad_old = width - self.cache_length
        pad_new = width - mask.shape[1]
        assert self.cache is not None and self.mask is not None
        old_layers: Any = self.cache.layers
        new_layers: Any = cache.layers
        for old, new in zip(old_layers, new_layers):
            old.keys = torch.cat([_pad_left(old.keys, pad_old), _pad_left(new.keys, pad_new)], dim=0)
            old.values = torch.cat([_pad_left(old.values, pad_old), _pad_left(new.values, pad_new)], dim=0)
        self.mask = torch.cat([_pad_left(self.mask, pad_old), _pad_left(mask, pad_new)], dim=0)


def _pad_left(t: torch.Tensor, amount: int) -> torch.Tensor:
    """Zero-pad the sequence dimension (-2 for KV tensors, -1 for masks) on the left."""
    if amount == 0:
        return t
    dim = -2 if t.dim() == 4 else -1
    shape = list(t.shape)
    shape[dim] = amount
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def layers_of(cache: DynamicCache) -> list[Any]:
    """The cache's full-attention layers (``keys`` and ``values`` of ``[batch, kv_heads, length, head_dim]``)."""
    return list(cache.layers)
