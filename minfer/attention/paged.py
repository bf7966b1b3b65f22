"""Paged attention in pure torch: write new keys/values into their slots, read context by block table.

One forward pass carries every token scheduled this step, flattened into rows
(N tokens, no padding). The linear layers treat them all alike; attention is the
only per-sequence part, in two groups:
- decode rows (one new token per sequence) are batched: their contexts are
  gathered from the cache into a padded (S, L) grid and masked (sequences of
  very different lengths go in separate groups, so little of the grid is padding),
  a few sequences at a time, so each gathered tile is read back from cache;
- prefill chunks (several new tokens of one sequence) attend causally, one chunk
  at a time (sdpa, or on a CPU two plain matmuls: cpu_tiled.py, path 5). A chunk
  with no earlier context (a fresh prompt) attends to its own new keys directly
  and skips the gather.
With grouped-query attention (Llama, Qwen3) the cache holds fewer key/value heads
than there are query heads; each group of query heads reads its shared key/value
head without copying it (sdpa's enable_gqa, or the group's queries stacked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..step_parts import part
from .cpu_tiled import ContextReader, causal_attention_by_matmuls

if TYPE_CHECKING:
    from .kv_cache import KVCache


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past its last row
    context_slots: torch.Tensor | None  # (L,) cache slots of positions 0..L-1; None: no earlier context
    mask: torch.Tensor | None  # (T, L) bool, True where query i may attend to position j


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (S,) rows of these single-token sequences in the flattened batch
    slots: torch.Tensor  # (S, L) cache slots of each sequence's context, padded to the longest
    mask: torch.Tensor | None  # (S, 1, 1, L) bool, False on padding; None when nothing is padded


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) cache slot for every new token's key/value
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    all_decode: bool = False  # one decode group holding every row, in order: no scatter needed
    reader: ContextReader = field(default_factory=ContextReader)  # the runner passes one it reuses


@dataclass
class PagedBatch:
    """What the model needs, beyond the token ids, to run one engine step (ModelRunner.prepare builds it)."""

    positions: torch.Tensor  # (N,) position of every token in its own sequence
    kv_cache: KVCache  # every layer's keys and values, in blocks
    attention: AttentionMetadata  # where each token's keys go and which context each sequence reads
    sample_rows: torch.Tensor  # (S,) rows that draw a token: the only ones the LM head sees


def paged_attention(
    q: torch.Tensor,  # (N, H, D)
    k: torch.Tensor,  # (N, Hkv, D): Hkv = H, or H / group size with grouped-query attention
    v: torch.Tensor,  # (N, Hkv, D)
    kv_cache: torch.Tensor,  # (num_slots, 2, Hkv, D) this layer's keys and values, a slot's key next to its value
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (N, H, D)
    # Store this step's keys and values first: the queries below attend to them too.
    with part("KV write"):
        kv_cache.index_copy_(0, meta.slot_mapping, torch.stack((k, v), dim=1))  # (N, 2, Hkv, D) into their slots

    if meta.all_decode:
        return decode_attention(q, kv_cache, meta.decode_groups[0], meta, scale)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        out[group.rows] = decode_attention(q[group.rows], kv_cache, group, meta, scale)
    for chunk in meta.prefills:
        qs = q[chunk.start : chunk.end].transpose(0, 1)  # (H, T, D)
        if chunk.context_slots is None:  # fresh prompt: its own keys are the whole context
            ks = k[chunk.start : chunk.end].transpose(0, 1)  # (Hkv, T, D)
            vs = v[chunk.start : chunk.end].transpose(0, 1)
        else:  # continuing a prompt (chunked prefill, prefix-cache hit): read the cache
            with part("context read"):
                kv = meta.reader.read(kv_cache, chunk.context_slots)  # (L, 2, Hkv, D)
                ks, vs = kv.permute(1, 2, 0, 3)  # 2 x (Hkv, L, D)
        with part("attention"):
            y = chunk_attention(qs, ks, vs, chunk.mask, scale)  # (H, T, D)
        out[chunk.start : chunk.end] = y.transpose(0, 1)  # (T, H, D)
    return out


def chunk_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk: q (H, T, D) are the last T of the L positions in k, v (Hkv, L, D);
    mask (T, L) says the same, or is None when T == L. Returns (H, T, D) in q's dtype."""
    if q.device.type == "cpu":  # plain matmuls beat CPU sdpa at many queries (cpu_tiled.py, path 5)
        return causal_attention_by_matmuls(q, k, v, scale)
    gqa = q.shape[0] != k.shape[0]
    y = F.scaled_dot_product_attention(
        q.to(k.dtype), k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )
    return y.to(q.dtype)


def decode_attention(q, kv_cache, group: DecodeGroup, meta: AttentionMetadata, scale: float):
    """q (S, H, D): one query per sequence against its whole context. Returns (S, H, D).

    The context is read a tile of sequences at a time, so each gathered tile is still in
    cache when sdpa reads it (cpu_tiled.ContextReader)."""
    S, L = group.slots.shape
    step = meta.reader.seqs_per_tile(kv_cache, L) or S
    queries = q.unsqueeze(2).to(meta.reader.dtype_read(kv_cache))  # (S, H, 1, D)
    gqa = q.shape[1] != kv_cache.shape[2]
    out = torch.empty_like(q).unsqueeze(2)  # (S, H, 1, D)
    for i in range(0, S, step):
        with part("context read"):
            kv = meta.reader.read(kv_cache, group.slots[i : i + step])  # (T, L, 2, Hkv, D)
            ks, vs = kv.permute(2, 0, 3, 1, 4)  # 2 x (T, Hkv, L, D)
        mask = None if group.mask is None else group.mask[i : i + step]  # (T, 1, 1, L)
        with part("attention"):
            y = F.scaled_dot_product_attention(
                queries[i : i + step], ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
            out[i : i + step] = y  # (T, H, 1, D), back in q's dtype
    return out.squeeze(2)
