"""Per-row token sampling over a batch of logits (torch).

Each row has its own temperature, top-k, top-p and seed. Greedy rows
(temperature 0) take the arg-max. Other rows are sampled by inverse CDF with
one uniform number drawn from a ``torch.Generator`` seeded with
``mix_seed(request seed, completion index)``, so the draw for a token does not
depend on the batch it ran in or on how many tokens this engine generated
before (see :mod:`randomness`).

Logprobs: the log-probability of the chosen token under the distribution
actually sampled from, i.e. ``log_softmax`` of the *processed* logits
(divided by the temperature, then top-k and top-p filtered and
renormalised). Greedy rows report ``log_softmax`` of the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .randomness import mix_seed
from .request_state import RowSpec


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSpec]) -> list[tuple[int, float]]:
    """Choose one token per row of ``logits`` (shape ``[len(rows), vocab]``)."""
    logits = logits.float()
    out: list[tuple[int, float]] = [(0, 0.0)] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.sampling.temperature == 0]
    sampled = [i for i, r in enumerate(rows) if r.sampling.temperature != 0]
    if greedy:
        sub = logits[greedy]
        tokens = sub.argmax(dim=-1)
        chosen = torch.log_softmax(sub, dim=-1).gather(1, tokens[:, None])[:, 0]
        for i, tok, lp in zip(greedy, tokens.tolist(), chosen.tolist()):
            out[i] = (tok, lp)
    if sampled:
        for i, pair in zip(sampled, _sample(logits[sampled], [rows[i] for i in sampled])):
            out[i] = pair
    return out


def _sample(logits: torch.Tensor, rows: list[RowSpec]) -> list[tuple[int, float]]:
    n, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=device)
    scaled = logits / temps[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([r.sampling.top_k if r.sampling.top_k > 0 else vocab for r in rows], device=device)
    ordered = ordered.masked_fill(ranks >= top_k[:, None], float("-inf"))
    top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=device)
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(ordered, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # The first token always survives: its mass_before is 0 < top_p.
        ordered = ordered.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    logp = torch.log_softmax(ordered, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    generator = torch.Generator(device="cpu")
    draws = []
    for r in rows:
        generator.manual_seed(mix_seed(r.seed, r.completion_index))
        draws.append(torch.rand((), generator=generator).item())
    u = torch.tensor(draws, dtype=torch.float32, device=device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None].contiguous(), right=True)
    # Kept tokens form a prefix of the sorted order; never step past it on rounding.
    last_kept = (logp > float("-inf")).sum(dim=-1, keepdim=True) - 1
    pick = torch.minimum(pick, last_kept)
    tokens = order.gather(1, pick)[:, 0]
    chosen = logp.gather(1, pick)[:, 0]
    return list(zip(tokens.tolist(), chosen.tolist()))
