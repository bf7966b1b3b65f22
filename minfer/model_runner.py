"""Turn one scheduler step into one forward pass: flatten, build metadata, run, sample.

The scheduler decides *what* runs (which tokens of which sequences); the runner
decides *how*: it lays every scheduled token out as one row of an (N, C) batch,
computes each row's position and cache slot, runs the model once, applies the
LM head only to the rows that draw a token, samples the whole batch at once, and
syncs with the host exactly once (`.tolist()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .model import GPT2
from .paged_attention import AttentionMetadata, PrefillChunk
from .sampling import sample
from .sequence import Sequence


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of `seq` this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """A chunk that reaches the sequence's last token produces the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


class ModelRunner:
    def __init__(self, model: GPT2, kv_cache: KVCache, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run one step. Returns the sampled token of every sampling chunk, in chunk order."""
        input_ids, positions, meta, sample_rows = self.prepare(chunks)
        hidden = self.model.forward_paged(input_ids, positions, self.kv_cache, meta)  # (N, C)
        logits = self.model.compute_logits(hidden[sample_rows])  # (S, V): LM head on sampling rows only
        sampling = [c.seq for c in chunks if c.samples]
        tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        return tokens.tolist()  # the step's single host sync

    def prepare(self, chunks: list[ScheduledChunk]):
        """Flatten the chunks into rows and describe, for attention, where each row's context is."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[tuple[int, int, int, list[int]]] = []  # (first row, num rows, start pos, table)
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            row = len(input_ids)
            table = seq.block_table
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if chunk.num_tokens == 1:
                decode_rows.append(row)
                decode_lens.append(end)
                decode_tables.append(table)
            else:
                prefills.append((row, chunk.num_tokens, start, table))
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)

        # One host->device copy for all the flat per-token integers.
        N, S, D = len(input_ids), len(sample_rows), len(decode_rows)
        flat = torch.tensor(input_ids + positions + slots + sample_rows + decode_rows + decode_lens)
        flat = flat.to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, sample_t, drows_t, dlens_t = flat.split([N, N, N, S, D, D])

        meta = AttentionMetadata(
            slot_mapping=slots_t, decode_rows=None, decode_slots=None, decode_mask=None, prefills=[]
        )
        if D:
            max_len = max(decode_lens)
            max_blocks = -(-max_len // bs)
            padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in decode_tables]
            tables = torch.tensor(padded).to(self.device, non_blocking=True)  # (D, max_blocks)
            pos = torch.arange(max_len, device=self.device)  # (L,)
            meta.decode_rows = drows_t
            meta.decode_slots = tables[:, pos // bs] * bs + pos % bs  # (D, L)
            meta.decode_mask = (pos[None, :] < dlens_t[:, None])[:, None, None, :]  # (D, 1, 1, L)
            meta.all_decode = D == N
        for row, num, start, table in prefills:
            if start == 0:  # a fresh prompt needs no cache reads
                meta.prefills.append(PrefillChunk(row, row + num, None, None))
                continue
            end = start + num
            table_t = torch.tensor(table[: -(-end // bs)], device=self.device)
            pos = torch.arange(end, device=self.device)  # (L,) context positions
            context_slots = table_t[pos // bs] * bs + pos % bs  # (L,)
            query_pos = torch.arange(start, end, device=self.device)  # (T,)
            mask = pos[None, :] <= query_pos[:, None]  # (T, L) causal over the whole context
            meta.prefills.append(PrefillChunk(row, row + num, context_slots, mask))
        return ids_t, pos_t, meta, sample_t
