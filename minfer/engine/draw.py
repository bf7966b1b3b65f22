"""Inverse-CDF sampling: a token per row from one uniform draw against the cumulative probabilities.
The sampler (sampling.py) draws every sampled row this way, filtered (top_k_top_p.py) or not."""

from __future__ import annotations

import torch


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row of probs (R, K), which need not sum to 1, the first index
    whose cumulative probability passes u (R,) in [0, 1) times the row's total. Index i comes up with
    probability probs[i] / total, and a zero entry never does. probs is overwritten. A row with nothing to
    draw from (all zero, or NaN: its logits were all -inf) gets the last index, never one past the end."""
    cdf = probs.cumsum_(dim=-1)  # (R, K), non-decreasing
    total = cdf[:, -1:]  # (R, 1)
    target = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))  # < total, even rounded
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)  # (R,)
