"""Turn one scheduler step into one forward pass: flatten, build metadata, run, sample.

The scheduler decides *what* runs (which tokens of which sequences); the runner
decides *how*: it lays every scheduled token out as one row of an (N, C) batch,
computes each row's position and cache slot, runs the model once, applies the
LM head only to the rows that draw a token, samples the whole batch at once, and
syncs with the host exactly once (`.tolist()`).
"""

from __future__ import annotations

import torch

from ..attention.cpu_tiled import ContextReader
from ..attention.kv_cache import KVCache, cdiv, slot_of
from ..attention.paged import AttentionMetadata, DecodeGroup, PagedBatch, PrefillChunk
from ..step_parts import part
from .cpu_packing import optimize_for_cpu
from .sampling import sample
from .sequence import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        if self.device.type == "cpu":  # prepacked linears and LM head (cpu_packing.py); a no-op the 2nd time
            optimize_for_cpu(model)
        self.reader = ContextReader()  # its gather buffers are reused across layers and steps

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run one step. Returns the sampled token of every sampling chunk, in chunk order."""
        with part("host: prepare"):
            input_ids, batch = self.prepare(chunks)
        logits = self.model(input_ids[None], batch)[0]  # (S, V): one forward, every sequence's tokens in one row
        with part("sampling"):
            sampling = [c.seq for c in chunks if c.produces_token]
            tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
            return tokens.tolist()  # the step's single host sync

    def prepare(self, chunks: list[ScheduledChunk]):
        """Flatten the chunks into rows and describe, for attention, where each row's context is."""
        block_size = self.block_size
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
            slots += [slot_of(table, p, block_size) for p in range(start, end)]
            if chunk.num_tokens == 1:
                decode_rows.append(row)
                decode_lens.append(end)
                decode_tables.append(table)
            else:
                prefills.append((row, chunk.num_tokens, start, table))
            if chunk.produces_token:
                sample_rows.append(len(input_ids) - 1)

        # One host->device copy for all the flat per-token integers.
        N, S = len(input_ids), len(sample_rows)
        flat = torch.tensor(input_ids + positions + slots + sample_rows).to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, sample_t = flat.split([N, N, N, S])

        meta = AttentionMetadata(slots_t, [], [], reader=self.reader)
        for group in group_by_length(decode_lens):
            meta.decode_groups.append(
                self.decode_group(
                    [decode_rows[i] for i in group], [decode_lens[i] for i in group], [decode_tables[i] for i in group]
                )
            )
        meta.all_decode = len(meta.decode_groups) == 1 and len(decode_rows) == N
        for row, num, start, table in prefills:
            if start == 0:  # a fresh prompt needs no cache reads
                meta.prefills.append(PrefillChunk(row, row + num, None, None))
                continue
            end = start + num
            table_t = torch.tensor(table[: cdiv(end, block_size)], device=self.device)
            pos = torch.arange(end, device=self.device)  # (L,) context positions
            context_slots = slot_of(table_t, pos, block_size)  # (L,)
            query_pos = torch.arange(start, end, device=self.device)  # (T,)
            mask = pos[None, :] <= query_pos[:, None]  # (T, L) causal over the whole context
            meta.prefills.append(PrefillChunk(row, row + num, context_slots, mask))
        return ids_t, PagedBatch(pos_t, self.kv_cache, meta, sample_t)

    def decode_group(self, rows: list[int], lens: list[int], tables: list[list[int]]) -> DecodeGroup:
        """Slots of each sequence's context, padded to the group's longest, and the padding mask."""
        block_size = self.block_size
        max_len = max(lens)
        max_blocks = cdiv(max_len, block_size)
        null = self.kv_cache.null_block
        padded = [t[:max_blocks] + [null] * (max_blocks - min(len(t), max_blocks)) for t in tables]
        ints = torch.tensor([rows, lens]).to(self.device, non_blocking=True)  # (2, S)
        tables_t = torch.tensor(padded).to(self.device, non_blocking=True)  # (S, max_blocks)
        pos = torch.arange(max_len, device=self.device)  # (L,)
        slots = slot_of(tables_t, pos, block_size)  # (S, L)
        if min(lens) == max_len:  # nothing padded: no mask at all (sdpa is faster without one)
            return DecodeGroup(rows=ints[0], slots=slots, mask=None)
        valid = pos[None, :] < ints[1][:, None]  # (S, L)
        # Padding must read the zeroed null block, even inside a sequence's own last block:
        # its unwritten slots may hold NaN, and a masked NaN still poisons the sum (0 * NaN).
        slots = torch.where(valid, slots, null * block_size)
        return DecodeGroup(rows=ints[0], slots=slots, mask=valid[:, None, None, :])  # mask (S, 1, 1, L)


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
