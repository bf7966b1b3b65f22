"""Turn one scheduler step into one forward pass: flatten, build metadata, run, sample.

The scheduler decides *what* runs (which tokens of which sequences); the runner decides *how*: it lays every
scheduled token out as one row of an (N, C) batch, computes each row's position and cache slot, describes
the step to the attention backend (a `StepLayout`, from which it builds its metadata), runs the model once,
applies the LM head only to the rows that draw a token, samples the whole batch at once, and syncs with the
host exactly once (`.tolist()`).

Four features act here, each where its line says: scoring/ reads logprobs off the logits before sampling,
structured/ masks what a request's grammar forbids (its masks computed while the forward runs),
speculative/ samples its verify rows by its acceptance rule, and compiled/ runs the forward as a compiled
graph or a CUDA graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..attention.kv_cache import KVCache, slot_of
from ..attention.backend import AttentionBackend, StepLayout
from ..attention.paged import PagedBatch
from ..host_to_device import to_device
from ..step_parts import part
from .sampling import sample
from .sequence import ScheduledChunk


@dataclass
class StepRows:
    """One step flattened: N rows (a token each), S of them sampled."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,) each token's position in its sequence
    sample_rows: torch.Tensor  # (S,) the rows the LM head reads, in chunk order
    layout: StepLayout  # for attention: each query run's rows, context and block table; every row's slot


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        attention: AttentionBackend,
        scoring=None,  # scoring/: logprobs read off the logits before sampling (engine/features.py: Scoring)
        speculation=None,  # speculative/: verify rows sampled by the acceptance rule (Speculation)
        compiled=None,  # compiled/: the forward as a compiled graph or a CUDA graph (Compiled)
        structured=None,  # structured/: the grammar's token mask on the sampled rows (Structured)
    ):
        self.model = model  # as the assembly prepared it: the runner never changes it
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention = attention  # builds each step's attention metadata, and runs it
        self.device = model.device
        self.scoring, self.speculation, self.compiled, self.structured = scoring, speculation, compiled, structured

    def warm_up(self) -> None:
        """Compile or capture what the forward needs before the first request (compiled/)."""
        if self.compiled is not None:
            self.compiled.warm_up(self)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run one step: a token for every sampled row, in chunk order (as each chunk's sampled_rows())."""
        with part("host: prepare"):
            rows = self.prepare(chunks)
            scoring = self.scoring if self.scoring is not None and self.scoring.live else None  # scoring/
            scores = scoring.rows(chunks, rows, self.device) if scoring is not None else None
            structured = self.structured if self.structured is not None and self.structured.live else None
            masks = structured.start(chunks) if structured is not None else None  # structured/: filled meanwhile
        logits = self.forward(rows)  # (S, V): one forward over the N tokens of every sequence
        with part("sampling"):
            if scores is not None:  # scoring/: raw logprobs, before sampling changes the logits
                logits = scores.score(logits)
            if masks is not None:  # structured/: what the grammar forbids at -inf, before any sampling control
                logits = masks.apply(logits)
            if self.speculation is not None:  # speculative/: verify rows keep or reject their proposals
                tokens, accepted = self.speculation.sample(chunks, logits)
            else:
                tokens, accepted = self.sample(chunks, logits), None
            if scores is None and accepted is None:
                return tokens.tolist()  # the step's single host sync
            return self.fetch(chunks, tokens, scores, accepted)

    def fetch(self, chunks: list[ScheduledChunk], tokens: torch.Tensor, scores, accepted) -> list[int]:
        """The tokens, and what scoring/ (`scores`) and speculative/ (`accepted`) read back, in the step's
        single host sync: one .tolist() of them all as floats (ids < 2**24 are exact)."""
        parts = [tokens] + (scores.tensors(tokens) if scores is not None else [])
        parts += [accepted] if accepted is not None else []
        values = iter(torch.cat([p.float().flatten() for p in parts]).tolist())
        host = [list(itertools.islice(values, p.numel())) for p in parts]  # each part's values
        token_list = [int(t) for t in host[0]]
        if scores is not None:
            scores.read(host[1], token_list)
        if accepted is not None:
            self.speculation.read(chunks, host[-1])
        return token_list

    @staticmethod
    def sample(chunks: list[ScheduledChunk], logits: torch.Tensor) -> torch.Tensor:
        """logits (S, V) of the sampled rows -> a token per row (S,), each by its sequence's params."""
        samplers = [seq for c in chunks for _, seq in c.sampled_rows()]
        return sample(logits, [s.params for s in samplers], [s.generator for s in samplers], samplers)

    def forward(self, rows: StepRows) -> torch.Tensor:
        """The model over every row of the step -> logits (S, V) of the sampled rows."""
        if self.compiled is not None:  # compiled/: a compiled graph or a CUDA graph, where one serves the step
            logits = self.compiled.forward(rows)
            if logits is not None:
                return logits
        return self.model(rows.input_ids, self.batch(rows))

    def batch(self, rows: StepRows) -> PagedBatch:
        """What the model needs besides the token ids: positions, the cache, attention's metadata, sampled rows."""
        return PagedBatch(rows.positions, self.kv_cache, self.attention.build_metadata(rows.layout), rows.sample_rows)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepRows:
        """Flatten the chunks into rows and describe, for attention, where each row's context is."""
        block_size = self.block_size
        input_ids, positions, slots, sample_rows = [], [], [], []  # per row; sample_rows per sampled row
        starts, lens, context_lens, tables = [], [], [], []  # per query run: first row, rows, context after, blocks
        for chunk in chunks:
            first_row, table, end = len(input_ids), chunk.seq.block_table, chunk.start + chunk.num_rows
            for offset, num in chunk.query_runs():
                starts.append(first_row + offset)
                lens.append(num)
                context_lens.append(chunk.start + offset + num)
                tables.append(table)
            input_ids += chunk.input_ids()
            positions += range(chunk.start, end)
            slots += [slot_of(table, p, block_size) for p in range(chunk.start, end)]
            sample_rows += [first_row + row for row, _ in chunk.sampled_rows()]

        # One host->device copy for all the flat per-token integers.
        N, S = len(input_ids), len(sample_rows)
        flat = to_device(input_ids + positions + slots + sample_rows, self.device)
        ids_t, pos_t, slots_t, sample_t = flat.split([N, N, N, S])
        layout = StepLayout(slots_t, starts, lens, context_lens, tables, block_size, self.kv_cache.null_block)
        return StepRows(ids_t, pos_t, sample_t, layout)

