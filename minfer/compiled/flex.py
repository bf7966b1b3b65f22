"""The FlexAttention backend: decode rows and prefill chunks read the paged cache in place, on any device.
What "auto" (and "compiled") mean on a GPU.

torch's FlexAttention (torch.nn.attention.flex_attention) computes attention tile by tile and
visits only the key/value blocks a `BlockMask` lists for each tile of queries. A sequence's
block table is exactly such a list. So the whole cache goes in as one long key/value sequence,
(1, Hkv, num_slots, D), and each sequence's queries read its own blocks where they lie: no
gather, no copy of the context. Within a listed block, `mask_mod` decides key by key: a key at
position p of its sequence is visible to a query at position q when p <= q (causal, and past
the end of a last, partly written block, nothing). A block's position in its sequence is the
same in every sequence that holds it (prefix caching shares whole prefixes, which start at
position 0), so one tensor over all blocks, `block_index`, gives any slot's position.

- Decode rows (one query per sequence): one call for the step, a batch of S sequences.
- Prefill chunks with earlier context (chunked prefill, a prefix-cache hit): one call each.
- Fresh prompts: sdpa over their own keys, causal, as the plain backend does (no cache read).

flex_attention runs fast only compiled (Triton kernels on a GPU, C++ loops on a CPU): flex_kernel.py
says how, and for which shapes. `warm_up` compiles before the engine starts and checks the results
against the plain backend; if anything fails, the engine runs the plain backend and says why. Where
flex serves (a GPU) it `compiles_per_shape`: the engine then runs one step of each kind through it
before the first request (warm_up.py), and a recompile after that is a path failure (forward.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from ..host_to_device import to_device
from ..step_parts import part
from .attention import check_within
from .flex_kernel import QUERY_TILE, compiled_flex_attention, compiling_for_serving, kernel_options, serves_on
from .flex_kernel import torch_too_old
from ..attention.kv_cache import KVCache, cdiv, padded_tables
from ..attention.backend import AttentionMetadata, StepLayout
from ..attention.torch_sdpa import TorchBackend

if TYPE_CHECKING:  # flex_attention loads the compiler: imported where first used (importing minfer stays light)
    from torch.nn.attention.flex_attention import BlockMask

WARM_UP_BUDGET_S = 120.0  # longest the start-up compile may take before the engine gives up on it


@dataclass
class FlexMetadata(AttentionMetadata):
    """A step's attention for the flex backend: its decode rows, as one batch, and its prefill chunks."""

    decode_rows: torch.Tensor | None = None  # (S,) rows of the decode queries
    decode_mask: BlockMask | None = None  # their sequences' blocks
    chunks: list[tuple[int, int, BlockMask | None]] = field(default_factory=list)  # rows, blocks (None: fresh)


def paged_block_mask(
    tables: torch.Tensor,  # (S, W) each sequence's blocks, padded with any block past its own
    num_blocks: torch.Tensor,  # (S,) how many of them it reads
    query_positions: torch.Tensor,  # (S, T) each query's position in its sequence
    block_index: torch.Tensor,  # (num_cache_blocks,) each block's position in the sequences that hold it
    block_size: int,
    num_slots: int,  # the cache's slots: the key/value length flex_attention sees
    pad_columns: int | None = None,  # the CPU's lowering wants a column per cache block
) -> BlockMask:
    """The BlockMask of S sequences of T queries each, reading their blocks of the paged cache."""
    from torch.nn.attention.flex_attention import BlockMask

    if tables.shape[1] < 2:  # a width of 1 would compile a kernel of its own: pad with the null block
        tables = torch.nn.functional.pad(tables, (0, 1), value=num_slots // block_size - 1)
    S, W = tables.shape
    T = query_positions.shape[1]
    tiles = cdiv(T, QUERY_TILE)

    # What the mask reads, as tensors only (a captured Python int is one more size to specialise on).
    flat_tables = tables.flatten()  # (S * W,)
    row_starts = torch.arange(S, device=tables.device) * W  # (S,) where each sequence's table starts in it
    last_column = torch.full((S,), W - 1, device=tables.device)  # (S,)

    def visible(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        index = torch.minimum(block_index[block], last_column[b])  # the block's place in its sequences' tables
        position = index * block_size + kv_idx % block_size
        # Its own sequence's block (the mask alone says so, so that flex_attention's unfused fallback, which
        # reads every block, is right too), and not after the query.
        return (flat_tables[row_starts[b] + index] == block) & (position <= query_positions[b, q_idx])

    columns = tables
    if pad_columns is not None and pad_columns > W:
        columns = torch.nn.functional.pad(tables, (0, pad_columns - W))
    kv_num_blocks = num_blocks.int().view(S, 1, 1).expand(S, 1, tiles).contiguous()  # (S, 1, tiles)
    kv_indices = columns.int().view(S, 1, 1, -1).expand(S, 1, tiles, -1).contiguous()  # (S, 1, tiles, W)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        BLOCK_SIZE=(QUERY_TILE, block_size),
        mask_mod=visible,
        seq_lengths=(T, num_slots),
        compute_q_blocks=False,  # what a backward pass needs: inference never runs one
    )


def offset_memory(shape, device, dtype, zeroed: bool) -> torch.Tensor:
    """A cache's tensor 128 bytes into its allocation, so that no layer's key view starts at offset 0: Dynamo
    specialises an offset of 0 (or 1), and layer 0 would compile a kernel of its own for every kind of step.
    128 bytes keep every view as aligned as at offset 0: Inductor copies an input it finds misaligned."""
    offset = 128 // torch.empty((), dtype=dtype).element_size()
    memory = (torch.zeros if zeroed else torch.empty)(offset + math.prod(shape), device=device, dtype=dtype)
    return memory[offset:].view(shape)


class FlexBackend(TorchBackend):
    """The plain backend's cache ("slots": a slot's key beside its value) and fresh-prompt path; decode
    rows and prefill chunks with context through FlexAttention over the block tables."""

    name = "flex"
    captures_in_graphs = True  # graph_metadata builds a step's block mask by device ops alone (cuda_graphs.py)

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        super().__init__(device, dtype)
        self.block_index: torch.Tensor | None = None  # (null_block + 1,): sized by the first step
        self.compiles_per_shape = serves_on(self.device)  # the engine's warm-up runs each kind of step (warm_up.py)

    def new_cache(self, config, num_blocks: int, block_size: int, device, dtype) -> KVCache:
        """The plain cache (KVCache itself: the same layout as the plain backend's), zeroed: a masked key's weight
        is 0, but its value is still multiplied, and 0 x NaN is NaN (kv_cache.py). Its memory starts 128 bytes
        into its allocation (`offset_memory`), through the allocation KVCache.__init__ calls, `self.allocate`."""
        cache = KVCache.__new__(KVCache)
        cache.allocate = offset_memory
        cache.__init__(config, num_blocks, block_size, device, dtype, zeroed=True)
        return cache

    # ---- once per step ----------------------------------------------------------------------

    def build_metadata(self, layout: StepLayout) -> FlexMetadata:
        B, null = layout.block_size, layout.null_block
        meta = FlexMetadata(layout.slot_mapping, self)
        decodes = [i for i, n in enumerate(layout.query_lens) if n == 1]
        reading = decodes + [i for i, n in enumerate(layout.query_lens) if n > 1 and layout.context_lens[i] > n]
        tables = self._tables(layout, reading)  # (R, W) on the device
        self._index_blocks(tables, null)
        if decodes:
            lens = [layout.context_lens[i] for i in decodes]
            rows, lens_t = to_device([[layout.query_starts[i] for i in decodes], lens], self.device)
            meta.decode_rows = rows  # (S,)
            meta.decode_mask = self._decode_mask(tables[: len(decodes)], lens_t, B, null)
        meta.all_decode = len(decodes) == len(layout.query_lens)
        row = len(decodes)
        for i, num in enumerate(layout.query_lens):
            if num == 1:
                continue
            start, end, context = layout.query_starts[i], layout.query_starts[i] + num, layout.context_lens[i]
            if context == num:  # a fresh prompt: its own keys are its whole context
                meta.chunks.append((start, end, None))
                continue
            positions = torch.arange(context - num, context, device=self.device)[None]  # (1, T)
            blocks = torch.full((1,), cdiv(context, B), device=self.device)
            mask = paged_block_mask(tables[row : row + 1], blocks, positions, self.block_index, B, *self._kv(B, null))
            meta.chunks.append((start, end, mask))
            row += 1
        return meta

    def graph_metadata(self, slot_mapping, tables, context_lens, block_size: int, null_block: int) -> FlexMetadata:
        """An all-decode step's metadata from fixed buffers, by device ops alone, so a CUDA graph records
        it (engine/cuda_graphs.py): slot_mapping (S,), tables (S, W) padded with the null block, context
        lengths (S,)."""
        self._index_blocks(tables, null_block)
        mask = self._decode_mask(tables, context_lens, block_size, null_block)
        return FlexMetadata(slot_mapping, self, decode_mask=mask, all_decode=True)

    def _decode_mask(self, tables, lens, block_size: int, null_block: int) -> BlockMask:
        """S sequences of one query each, at their last position: tables (S, W), lens (S,)."""
        blocks = (lens + block_size - 1) // block_size  # (S,)
        last = (lens - 1)[:, None]  # (S, 1) each query's position
        return paged_block_mask(tables, blocks, last, self.block_index, block_size, *self._kv(block_size, null_block))

    def _kv(self, block_size: int, null_block: int) -> tuple[int, int | None]:
        """paged_block_mask's last two arguments: the cache's slots, and the columns a CPU wants."""
        return (null_block + 1) * block_size, (null_block + 1 if self.device.type == "cpu" else None)

    def _tables(self, layout: StepLayout, seqs: list[int]) -> torch.Tensor:
        """The block tables of `seqs` as one (R, W) device tensor, padded with the null block."""
        B, null = layout.block_size, layout.null_block
        tables = [layout.block_tables[i][: cdiv(layout.context_lens[i], B)] for i in seqs]
        width = max((len(t) for t in tables), default=1)
        return to_device(padded_tables(tables, width, null) or [[null]], self.device, torch.long)  # (R, W)

    def _index_blocks(self, tables: torch.Tensor, null_block: int) -> None:
        """Record each listed block's place in its sequence's table in self.block_index: tables (R, W)."""
        if self.block_index is None or self.block_index.shape[0] != null_block + 1:
            self.block_index = torch.zeros(null_block + 1, dtype=torch.long, device=self.device)
        # Padding names the null block at every column: whichever write wins, no sequence reads it.
        self.block_index[tables] = torch.arange(tables.shape[1], device=self.device).expand_as(tables)

    # ---- once per layer ---------------------------------------------------------------------

    def forward(self, q, k, v, kv_cache, meta: FlexMetadata, scale: float) -> torch.Tensor:
        """q (N, H, D), k and v (N, Hkv, D), kv_cache (num_slots, 2, Hkv, D) -> (N, H, D)."""
        with part("KV write"):
            self.write_kv(kv_cache, meta.slot_mapping, k, v)
        keys = kv_cache[:, 0].transpose(0, 1)[None]  # (1, Hkv, num_slots, D): a view, no copy
        values = kv_cache[:, 1].transpose(0, 1)[None]
        gqa = q.shape[1] != kv_cache.shape[2]
        with part("attention"):
            if meta.all_decode:
                return self._attend(q[:, :, None], keys, values, meta.decode_mask, scale, gqa)[:, :, 0]
            out = torch.empty_like(q)
            if meta.decode_rows is not None:
                queries = q[meta.decode_rows][:, :, None]  # (S, H, 1, D)
                out[meta.decode_rows] = self._attend(queries, keys, values, meta.decode_mask, scale, gqa)[:, :, 0]
            for start, end, mask in meta.chunks:
                qs = q[start:end].transpose(0, 1)  # (H, T, D)
                if mask is None:  # a fresh prompt
                    ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # (Hkv, T, D)
                    y = self.prefill_attention(qs, ks, vs, None, scale)  # (H, T, D)
                else:
                    y = self._attend(qs[None], keys, values, mask, scale, gqa)[0]
                out[start:end] = y.transpose(0, 1)  # (T, H, D)
            return out

    def _attend(self, q, keys, values, mask: BlockMask, scale: float, gqa: bool) -> torch.Tensor:
        """q (S, H, T, D) over keys and values (1, Hkv, num_slots, D), through the mask -> (S, H, T, D)."""
        q = q.contiguous()  # one layout, whatever the model made (GPT-2's q is a strided slice): Dynamo guards on it
        if not self.compiles_per_shape:  # a CPU, where flex is the tests' (selector.py)
            return compiled_flex_attention(dynamic=False)(q, keys, values, block_mask=mask, scale=scale, enable_gqa=gqa)
        compiled, options = compiled_flex_attention(dynamic=True), kernel_options(q.shape[2], mask.BLOCK_SIZE[1])
        return compiled(q, keys, values, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options)

    # ---- before the engine starts -----------------------------------------------------------

    def warm_up(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16, budget_s: float = WARM_UP_BUDGET_S
    ) -> str | None:
        """Compile for these shapes and check against the plain backend. None when flex may serve,
        else why not (the engine then runs the plain backend)."""
        if block_size < 16:
            return f"FlexAttention reads blocks of at least 16 tokens, not {block_size}"
        if self.compiles_per_shape and (too_old := torch_too_old()):
            return too_old

        def check():
            with compiling_for_serving():
                return self._check(num_heads, num_kv_heads, head_dim, block_size)

        why_not, self.warm_up_seconds = check_within(check, budget_s)
        return why_not

    @torch.inference_mode()
    def _check(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
        """Decode batches (one sequence and several) and a prefill chunk over earlier context, against
        TorchBackend on the same cache, whose unwritten slots hold large garbage."""
        plain = TorchBackend(self.device, self.dtype)
        gen = torch.Generator().manual_seed(0)
        num_blocks, B = 12, block_size
        # Unwritten slots hold what an old sequence left there: large, finite (the cache starts zeroed).
        cache = 100 * torch.randn((num_blocks + 1) * B, 2, num_kv_heads, head_dim, generator=gen).to(self.dtype)
        cache[num_blocks * B :] = 0  # the null block
        two_layers = SimpleNamespace(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim)
        # (contexts, new tokens): decode batches, a chunk over earlier context, all three kinds in one step
        cases = [([1], [1]), ([37, 5, 20], [1, 1, 1]), ([40], [7]), ([9, 30, 6], [1, 12, 6])]
        tolerance = 1e-5 if self.dtype in (torch.float32, torch.float64) else 2e-2
        for lens, news in cases:
            tables = torch.randperm(num_blocks, generator=gen)[: 3 * len(lens)].view(len(lens), 3).tolist()
            for table, length in zip(tables, lens):  # every slot a sequence reads is written
                slots = [table[p // B] * B + p % B for p in range(length)]
                cache[slots] = torch.randn(length, 2, num_kv_heads, head_dim, generator=gen).to(self.dtype)
            kv = cache.to(self.device)
            N = sum(news)
            starts = [sum(news[:i]) for i in range(len(news))]
            slot_mapping = torch.tensor(  # the new tokens' own slots, rewritten with the values they hold
                [t[p // B] * B + p % B for t, n, c in zip(tables, news, lens) for p in range(c - n, c)]
            ).to(self.device)
            k, v = kv[slot_mapping, 0], kv[slot_mapping, 1]  # (N, Hkv, D)
            q = torch.randn(N, num_heads, head_dim, generator=gen).to(self.dtype).to(self.device)
            layout = StepLayout(slot_mapping, starts, news, lens, tables, B, num_blocks)
            # flex reads layer 1 of a cache made as the engine's is (a normal tensor: Dynamo guards on the kind,
            # the view's base and its offset); the plain backend a copy of it.
            with torch.inference_mode(False):
                ours = self.new_cache(two_layers, num_blocks, B, self.device, self.dtype)
                ours.kv[1].copy_(kv)
                theirs = kv.clone()
            got = self.forward(q, k, v, ours.kv[1], self.build_metadata(layout), head_dim**-0.5)
            want = plain.forward(q, k, v, theirs, plain.build_metadata(layout), head_dim**-0.5)
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance:
                return f"its results differ from the plain backend's by {error:.2g} (contexts {lens}, new {news})"
        return None
