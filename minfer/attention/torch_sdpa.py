"""The plain attention backend: gather each sequence's context from the cache, then sdpa. Any device.

Pure torch cannot attend through a block table: a sequence's keys and values are first gathered, by slot,
into a contiguous tensor. The step's rows fall into two groups:
- decode rows (one new token per sequence) are batched: their contexts are gathered into a padded (S, L)
  grid of slots and masked. Sequences of very different lengths go in separate groups (`group_by_length`),
  so little of the grid is padding;
- prefill chunks (several new tokens of one sequence) attend causally, one chunk at a time. A chunk with no
  earlier context (a fresh prompt) attends to its own new keys directly and skips the gather.
With grouped-query attention (Llama, Qwen3) the cache holds fewer key/value heads than there are query
heads; sdpa's enable_gqa lets each group of query heads read its shared key/value head without copying it.

The CPU's tiled backend (cpu/tiled_attention.py) is this one with its own `decode_attention`,
`chunk_context` and `prefill_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..host_to_device import to_device
from ..step_parts import part
from .kv_cache import cdiv, padded_tables, slot_of
from .backend import AttentionBackend, AttentionMetadata, StepLayout


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past its last row
    context_slots: torch.Tensor | None  # (L,) cache slots of positions 0..L-1; None: no earlier context
    mask: torch.Tensor | None  # (T, L) bool, True where query i may attend to position j


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (S,) rows of these single-token sequences in the flattened batch
    slots: torch.Tensor | None  # (S, L) cache slots of each sequence's context, padded to the longest
    mask: torch.Tensor | None  # (S, 1, 1, L) bool, False on padding; None when nothing is padded
    lens: torch.Tensor | None = None  # (S,) context lengths (what the compiled backend masks by)
    tables: torch.Tensor | None = None  # (S, NB) block tables, padded (the compiled backend reads by block)


@dataclass
class GatheredMetadata(AttentionMetadata):
    """The eager backends' metadata: decode groups and prefill chunks, each with the slots to gather."""

    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchBackend(AttentionBackend):
    """Any device. Its cache is the plain KVCache: a slot's key next to its value, one gather reads both."""

    name = "torch"

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        self.device = torch.device(device)
        self.dtype = dtype

    # ---- once per step: the runner's layout -> decode groups and prefill chunks -------------

    def build_metadata(self, layout: StepLayout) -> GatheredMetadata:
        meta = GatheredMetadata(layout.slot_mapping, self)
        decodes = [i for i, n in enumerate(layout.query_lens) if n == 1]
        for group in group_by_length([layout.context_lens[i] for i in decodes]):
            meta.decode_groups.append(self.decode_group(layout, [decodes[i] for i in group]))
        meta.all_decode = len(meta.decode_groups) == 1 and len(decodes) == len(layout.query_lens)
        for i, num in enumerate(layout.query_lens):
            if num > 1:
                meta.prefills.append(self.prefill_chunk(layout, i))
        return meta

    def prefill_chunk(self, layout: StepLayout, i: int) -> PrefillChunk:
        """Sequence i's chunk: its rows, the slots of its whole context, and the causal mask over it."""
        row, num, end = layout.query_starts[i], layout.query_lens[i], layout.context_lens[i]
        start = end - num
        if start == 0:  # a fresh prompt needs no cache reads
            return PrefillChunk(row, row + num, None, None)
        table_t = to_device(layout.block_tables[i][: cdiv(end, layout.block_size)], self.device)
        pos = torch.arange(end, device=self.device)  # (L,) context positions
        context_slots = slot_of(table_t, pos, layout.block_size)  # (L,)
        query_pos = torch.arange(start, end, device=self.device)  # (T,)
        mask = pos[None, :] <= query_pos[:, None]  # (T, L) causal over the whole context
        return PrefillChunk(row, row + num, context_slots, mask)

    def decode_group(self, layout: StepLayout, seqs: list[int]) -> DecodeGroup:
        """Slots of each sequence's context, padded to the group's longest, and the padding mask."""
        block_size, null = layout.block_size, layout.null_block
        lens = [layout.context_lens[i] for i in seqs]
        max_len = max(lens)
        padded = padded_tables([layout.block_tables[i] for i in seqs], cdiv(max_len, block_size), null)
        rows_t, lens_t = to_device([[layout.query_starts[i] for i in seqs], lens], self.device)  # 2 x (S,)
        pos = torch.arange(max_len, device=self.device)  # (L,)
        slots = slot_of(to_device(padded, self.device), pos, block_size)  # (S, max_blocks) tables -> (S, L)
        if min(lens) == max_len:  # nothing padded: no mask at all (sdpa is faster without one)
            return DecodeGroup(rows_t, slots, mask=None, lens=lens_t)
        valid = pos[None, :] < lens_t[:, None]  # (S, L)
        # Padding must read the zeroed null block, even inside a sequence's own last block:
        # its unwritten slots may hold NaN, and a masked NaN still poisons the sum (0 * NaN).
        slots = torch.where(valid, slots, null * block_size)
        return DecodeGroup(rows_t, slots, mask=valid[:, None, None, :], lens=lens_t)  # mask (S, 1, 1, L)

    # ---- once per layer: write this step's keys and values, then attend -----------------------

    def forward(self, q, k, v, kv_cache, meta: GatheredMetadata, scale: float) -> torch.Tensor:
        """q (N, H, D), k and v (N, Hkv, D), kv_cache (num_slots, 2, Hkv, D) -> (N, H, D)."""
        # Store this step's keys and values first: the queries below attend to them too.
        with part("KV write"):
            self.write_kv(kv_cache, meta.slot_mapping, k, v)

        if meta.all_decode:
            return self.decode_attention(q, kv_cache, meta.decode_groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            out[group.rows] = self.decode_attention(q[group.rows], kv_cache, group, scale)
        for chunk in meta.prefills:
            qs = q[chunk.start : chunk.end].transpose(0, 1)  # (H, T, D)
            if chunk.context_slots is None:  # fresh prompt: its own keys are the whole context
                ks = k[chunk.start : chunk.end].transpose(0, 1)  # (Hkv, T, D)
                vs = v[chunk.start : chunk.end].transpose(0, 1)
            else:  # continuing a prompt (chunked prefill, prefix-cache hit): read the cache
                with part("context read"):
                    ks, vs = self.chunk_context(kv_cache, chunk.context_slots)  # 2 x (Hkv, L, D)
            with part("attention"):
                y = self.prefill_attention(qs, ks, vs, chunk.mask, scale)  # (H, T, D)
            out[chunk.start : chunk.end] = y.transpose(0, 1)  # (T, H, D)
        return out

    def decode_attention(self, q, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        """q (S, H, D): one query per sequence against its whole context, gathered at once. Returns (S, H, D)."""
        with part("context read"):
            ks, vs = gather_slots(kv_cache, group.slots).permute(2, 0, 3, 1, 4)  # 2 x (S, Hkv, L, D)
        with part("attention"):
            gqa = q.shape[1] != kv_cache.shape[2]  # grouped queries: fewer K/V heads than query heads
            y = F.scaled_dot_product_attention(q[:, :, None], ks, vs, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
        return y.squeeze(2)  # (S, H, D)

    # ---- what a device may do its own way (cpu/tiled_attention.py's CPUTiledBackend does) -------

    def write_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v (N, Hkv, D) in their slots (N,) of kv_cache (num_slots, 2, Hkv, D)."""
        kv_cache.index_copy_(0, slots, torch.stack((k, v), dim=1))  # (N, 2, Hkv, D) into their slots

    def chunk_context(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's context: slots (L,) -> its keys and values, (2, Hkv, L, D)."""
        return gather_slots(kv_cache, slots).permute(1, 2, 0, 3)  # (L, 2, Hkv, D) -> (2, Hkv, L, D)

    def prefill_attention(self, q, k, v, mask, scale: float) -> torch.Tensor:
        """Causal attention of a prefill chunk: q (H, T, D) are the last T of the L positions in k, v
        (Hkv, L, D); mask (T, L) says the same, or is None when T == L or T == 1 (the last position sees
        them all). Returns (H, T, D) in q's dtype."""
        gqa = q.shape[0] != k.shape[0]
        causal = mask is None and q.shape[1] > 1
        # As a batch of one: sdpa takes its flash kernels for 4-d inputs only (3-d ran ~10x slower on a CPU).
        y = F.scaled_dot_product_attention(
            q.to(k.dtype)[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        return y[0].to(q.dtype)


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kv_cache (num_slots, 2, Hkv, D), slots (...) -> (..., 2, Hkv, D): kv_cache[slots], by index_select,
    which copies whole rows (2-4x faster on a CPU than indexing's general kernel)."""
    return kv_cache.index_select(0, slots.flatten()).view(*slots.shape, *kv_cache.shape[1:])


def group_by_length(lens: list[int], max_waste: float = 1.25) -> list[list[int]]:
    """Split sequences (indices into lens) into groups that each pad to their longest member,
    keeping padded size <= max_waste x the real size: each group costs a few extra kernel calls,
    but gathering and attending over padding costs memory bandwidth, the scarce resource."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    longest = total = 0
    for i in order:
        if groups and longest * (len(groups[-1]) + 1) <= max_waste * (total + lens[i]):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            longest = total = lens[i]
    return [sorted(g) for g in groups]  # in batch order: one group of every row needs no scatter
