"""Turn one scheduler step into one forward pass: flatten, build metadata, run, sample.

The scheduler decides *what* runs (which tokens of which sequences); the runner
decides *how*: it lays every scheduled token out as one row of an (N, C) batch,
computes each row's position and cache slot, describes the step to the attention
backend (a `StepLayout`, from which it builds its metadata), runs the model once,
applies the LM head only to the rows that draw a token (and the prompt positions whose
logprobs a request asked for), samples the whole batch at once, and syncs with the host
exactly once (`.tolist()`), logprobs included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.kv_cache import KVCache, slot_of
from ..attention.paged import AttentionBackend, PagedBatch, StepLayout
from ..step_parts import part
from .logprobs import StepLogprobs, TokenLogprob
from .sampling import sample
from .sequence import ScheduledChunk


@dataclass
class StepOutput:
    """What one step produced: a token per sampler (ScheduledChunk.samplers), in chunk order; the
    logprobs of the sampled tokens that asked, by sampler index; and, by chunk index, the logprobs of
    the chunks' prompt positions."""

    tokens: list[int]
    sample_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, attention_backend: AttentionBackend):
        self.model = model  # as prepare_model left it: the runner never changes it
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention_backend = attention_backend  # builds each step's attention metadata, and runs it
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Run one step: a token for every sampler of every chunk (ScheduledChunk.samplers), in chunk
        order, and the logprobs asked for."""
        with part("host: prepare"):
            input_ids, batch, wanted = self.prepare(chunks)
        logits = self.model(input_ids, batch)  # (S + Q, V): one forward over the N tokens of every sequence
        with part("sampling"):
            sampling = [s for c in chunks for s in c.samplers]  # a fork draws from its parent's row
            S = len(sampling)
            if not wanted.empty:
                wanted.score(logits)  # raw logprobs, before penalties, temperature and filters
            tokens = sample(logits[:S], [s.params for s in sampling], [s.generator for s in sampling], sampling)
            if wanted.empty:
                return StepOutput(tokens.tolist())  # the step's single host sync
            token_list, sample_lps, prompt_lps = wanted.fetch(tokens)  # still the only sync
            return self._by_sampler(chunks, token_list, sample_lps, prompt_lps)

    @staticmethod
    def _by_sampler(chunks, tokens, sample_lps, prompt_lps) -> StepOutput:
        """Hand each sampler the logprobs it asked for, and each chunk its prompt's, in the order
        prepare() laid the rows out."""
        out = StepOutput(tokens)
        sample_lps, prompt_lps = iter(sample_lps), iter(prompt_lps)
        row = 0
        for i, (chunk, rows) in enumerate(zip(chunks, _prompt_rows_per_chunk(chunks))):
            for seq in chunk.samplers:
                if seq.params.logprobs is not None:
                    out.sample_logprobs[row] = next(sample_lps)
                row += 1
            if rows:
                out.prompt_logprobs[i] = [next(prompt_lps) for _ in rows]
        return out

    def prepare(self, chunks: list[ScheduledChunk]):
        """Flatten the chunks into rows and describe, for attention, where each row's context is."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        wanted = StepLogprobs(sum(len(c.samplers) for c in chunks))
        prompt_rows: list[int] = []  # rows whose logits score the prompt token after them
        starts: list[int] = []  # per chunk: its first row, its rows, its context after the step, its blocks
        lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        for chunk, positions_scored in zip(chunks, _prompt_rows_per_chunk(chunks)):
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            first_row = len(input_ids)
            for p in positions_scored:  # prompt position p gives the logprob of prompt token p + 1
                prompt_rows.append(first_row + p - start)
                wanted.prompt_targets.append(seq.token_ids[p + 1])
                wanted.prompt_k = max(wanted.prompt_k, seq.params.prompt_logprobs)
            table = seq.block_table
            starts.append(len(input_ids))
            lens.append(chunk.num_tokens)
            context_lens.append(end)
            tables.append(table)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [slot_of(table, p, block_size) for p in range(start, end)]
            for sampler in chunk.samplers:  # n rows when n completions fork here
                if sampler.params.logprobs is not None:
                    wanted.sample_rows.append(len(sample_rows))
                    wanted.sample_k = max(wanted.sample_k, sampler.params.logprobs)
                sample_rows.append(len(input_ids) - 1)
        sample_rows += prompt_rows  # the LM head runs on these too, after the sampled rows

        # One host->device copy for all the flat per-token integers.
        N, S = len(input_ids), len(sample_rows)
        flat = torch.tensor(input_ids + positions + slots + sample_rows).to(self.device, non_blocking=True)
        ids_t, pos_t, slots_t, sample_t = flat.split([N, N, N, S])
        layout = StepLayout(slots_t, starts, lens, context_lens, tables, block_size, self.kv_cache.null_block)
        batch = PagedBatch(pos_t, self.kv_cache, self.attention_backend.build_metadata(layout), sample_t)
        return ids_t, batch, wanted


def _prompt_rows_per_chunk(chunks: list[ScheduledChunk]) -> list[range]:
    """For each chunk, the prompt positions whose logits it must score: those it computes that give a
    prompt token's logprob (position p scores token p + 1) not yet recorded (a recompute after a
    preemption skips what was). Empty for requests that did not ask for prompt logprobs."""
    out = []
    for chunk in chunks:
        seq = chunk.seq
        if seq.params.prompt_logprobs is None:
            out.append(range(0))
            continue
        first = max(chunk.start, len(seq.prompt_logprobs))
        out.append(range(first, min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)))
    return out
