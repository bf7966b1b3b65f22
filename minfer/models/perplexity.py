"""Perplexity of a causal language model on a stream of token ids: the plain forward, in sliding windows.

A text longer than the model's context is scored window by window (Hugging Face's "perplexity of
fixed-length models" method): windows of `window` tokens start every `stride` tokens, and each
window scores only the tokens no earlier window scored, so every token after the first is scored
exactly once, with at least `window - stride` tokens of context once the text is that long.
Perplexity is exp(total negative log-likelihood / tokens scored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Perplexity:
    nll: float  # summed negative log-likelihood, in nats
    tokens: int  # tokens scored: every token but the first

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats): the training loss."""
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first) per window: it runs on tokens [begin, end) and scores tokens [first, end)."""
    if not 0 < stride < window:  # windows must overlap: a window's first token has nothing before it
        raise ValueError(f"stride must be in [1, window - 1 = {window - 1}], got {stride}")
    scored = 1  # token 0 has nothing before it to predict it
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end > scored:
            yield begin, end, scored
            scored = end
        if end == num_tokens:
            break


@torch.inference_mode()
def perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor], token_ids: list[int] | torch.Tensor, window: int, stride: int
) -> Perplexity:
    """Score `token_ids` with `forward`: (1, T) ids -> (1, T, vocab) logits (minfer's plain model forward)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    nll, count = 0.0, 0
    for begin, end, first in windows(ids.numel(), window, stride):
        logits = forward(ids[None, begin:end])[0]  # (T, V)
        predicted_by = logits[first - 1 - begin : end - 1 - begin].float()  # the logits at t-1 predict token t
        targets = ids[first:end].to(logits.device)
        nll += F.cross_entropy(predicted_by, targets, reduction="sum").item()  # summed in Python's float64
        count += targets.numel()
    return Perplexity(nll, count)
