"""Turn one scheduler step into one forward pass: flatten, build metadata, run, sample.

The scheduler decides *what* runs (which tokens of which sequences); the runner
decides *how*: it lays every scheduled token out as one row of an (N, C) batch,
computes each row's position and cache slot, describes the step to the attention
backend (a `StepLayout`, from which it builds its metadata), runs the model once,
applies the LM head only to the rows that draw a token, samples the whole batch at
once, and syncs with the host exactly once (`.tolist()`).
"""

from __future__ import annotations

import torch

from ..attention.kv_cache import KVCache, slot_of
from ..attention.paged import AttentionBackend, PagedBatch, StepLayout
from ..step_parts import part
from .sampling import sample
from .sequence import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, attention_backend: AttentionBackend):
        self.model = model  # as prepare_model left it: the runner never changes it
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention_backend = attention_backend  # builds each step's attention metadata, and runs it
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run one step. Returns the sampled token of every sampler of every chunk (ScheduledChunk.samplers),
        in chunk order."""
        with part("host: prepare"):
            input_ids, batch = self.prepare(chunks)
        logits = self.model(input_ids, batch)  # (S, V): one forward over the N tokens of every sequence
        with part("sampling"):
            sampling = [s for c in chunks for s in c.samplers]  # a fork draws from its parent's row
            tokens = sample(logits, [s.params for s in sampling], [s.generator for s in sampling], sampling)
            return tokens.tolist()  # the step's single host sync

    def prepare(self, chunks: list[ScheduledChunk]):
        """Flatten the chunks into rows and describe, for attention, where each row's context is."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        starts: list[int] = []  # per chunk: its first row, its rows, its context after the step, its blocks
        lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            table = seq.block_table
            starts.append(len(input_ids))
            lens.append(chunk.num_tokens)
            context_lens.append(end)
            tables.append(table)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [slot_of(table, p, block_size) for p in range(start, end)]
            sample_rows += [len(input_ids) - 1] * len(chunk.samplers)  # n rows when n completions fork here

        # One host->device copy for all the flat per-token integers.
        N, S = len(input_ids), len(sample_rows)
        flat = torch.tensor(input_ids + positions + slots + sample_rows).to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, sample_t = flat.split([N, N, N, S])
        layout = StepLayout(slots_t, starts, lens, context_lens, tables, block_size, self.kv_cache.null_block)
        return ids_t, PagedBatch(pos_t, self.kv_cache, self.attention_backend.build_metadata(layout), sample_t)
