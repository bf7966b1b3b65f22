"""Paged attention: what a model's attention layer calls.

One forward pass carries every token scheduled this step, flattened into N rows (no padding, many
sequences side by side). The linear layers treat the rows alike; attention is the only per-sequence
part. Each layer calls

    paged_attention(q, k, v, kv_cache, meta, scale)   # (N, H, D) -> (N, H, D)

which writes this step's keys and values into their cache slots and lets every row attend over its
own sequence's context, read through the sequence's block table. How is the business of the attention
backend that built `meta` (backend.py). Models only call `paged_attention`; they never know which
backend runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import AttentionMetadata
from .kv_cache import KVCache


@dataclass
class PagedBatch:
    """What the model needs, beyond the token ids, to run one engine step (ModelRunner.prepare builds it)."""

    positions: torch.Tensor  # (N,) position of every token in its own sequence
    kv_cache: KVCache  # every layer's keys and values, in blocks
    attention: AttentionMetadata  # where each token's keys go and which context each sequence reads
    sample_rows: torch.Tensor  # (S,) rows the LM head sees: those that draw a token, then prompt rows scored


def paged_attention(
    q: torch.Tensor,  # (N, H, D)
    k: torch.Tensor,  # (N, Hkv, D): Hkv = H, or H / group size with grouped-query attention
    v: torch.Tensor,  # (N, Hkv, D)
    kv_cache: torch.Tensor,  # this layer's keys and values (num_slots, 2, Hkv, D), a slot's key next to its value
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (N, H, D)
    """Store this step's keys and values in the cache, then attend: each row over its own sequence's
    context (cached tokens and this step's, causally). The backend that built `meta` does the work."""
    return meta.backend.forward(q, k, v, kv_cache, meta, scale)
