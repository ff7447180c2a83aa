"""Logit filters for sampling: top-k, top-p (nucleus) and temperature, then one draw per row.

Filters return a copy of the logits with every excluded entry set to -inf, so they compose
(top-k first, then top-p over what is left) and a softmax of the result is the sampling distribution.
"""

from __future__ import annotations

import torch


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the `k` largest logits of each row (last dim), set the others to -inf.

    Args:
        logits: FloatTensor [..., V].
        k: how many entries to keep per row; None or k >= V keeps everything. Ties at the k-th value
            are broken by `torch.topk` (exactly k entries survive).
    """
    if k is None or k >= logits.shape[-1]:
        return logits
    if k < 1:
        raise ValueError(f"top_k must be >= 1 (or None to disable), got {k}")
    values, indices = torch.topk(logits, k, dim=-1)
    filtered = torch.full_like(logits, float("-inf"))
    return filtered.scatter(-1, indices, values)


def top_p_filter(logits: torch.Tensor, p: float | None) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely entries whose probabilities sum to >= `p`.

    The most likely entry is always kept. An entry is kept when the probability mass of the entries
    ranked strictly above it is still < p.

    Args:
        logits: FloatTensor [..., V] (entries already at -inf stay excluded).
        p: nucleus mass in (0, 1]; None or 1.0 disables the filter.
    """
    if p is None or p >= 1.0:
        return logits
    if not 0.0 < p < 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None to disable), got {p}")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of the entries ranked strictly above each one
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one index per row of `logits` [B, V] after temperature, top-k and top-p; returns LongTensor [B].

    Args:
        logits: FloatTensor [B, V] of unnormalised scores.
        temperature: divides the logits (< 1 sharpens, > 1 flattens); 0 means greedy argmax.
        top_k: keep only the k most likely entries (None: all).
        top_p: then keep the nucleus of mass p (None: all).
        generator: torch.Generator for reproducible draws (same generator state, same tokens).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(-1)
    logits = top_p_filter(top_k_filter(logits.float() / temperature, top_k), top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
