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
from ..host_to_device import to_device
from ..step_parts import part
from ..compiled.step import CompiledDecodeStep
from ..compiled.cuda_graphs import DecodeGraphs, DecodeGraphStep
from ..scoring.logprobs import StepLogprobs, TokenLogprob
from .sampling import sample
from .sequence import ScheduledChunk
from ..speculative.draft import DraftProposer
from ..speculative.verify import VerifyRows, verify


@dataclass
class StepOutput:
    """What one step produced: a token per sampler (ScheduledChunk.samplers), in chunk order; the
    logprobs of the sampled tokens that asked, by sampler index; and, by chunk index, the logprobs of
    the chunks' prompt positions."""

    tokens: list[int]  # a speculating chunk has k + 1 rows: see num_accepted
    sample_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # By chunk index, for speculating chunks: how many proposals were accepted (a). The chunk's rows
    # give its tokens: the first a + 1 of them are the sequence's next tokens (speculative/verify.py).
    num_accepted: dict[int, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        attention_backend: AttentionBackend,
        draft: DraftProposer | None = None,  # speculative decoding's draft model, on the same blocks
        compile_decode_step: bool = False,  # all-decode steps through one compiled graph (compiled_step.py)
        whole_graph: bool = False,  # that graph the whole forward, weights frozen in, for most steps (--compile-model)
        decode_graphs: DecodeGraphs | None = None,  # all-decode steps replayed from CUDA graphs (cuda_graphs.py)
    ):
        self.model = model  # as prepare_model left it: the runner never changes it
        self.forward = CompiledDecodeStep(model, whole_graph) if compile_decode_step else model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention_backend = attention_backend  # builds each step's attention metadata, and runs it
        self.device = model.device
        self.draft = draft
        self.decode_graphs = decode_graphs

    @torch.inference_mode()  # as every step runs: Dynamo guards on it
    def warm_up(self) -> None:
        """Compile and capture what does before the first request (compiled_step.py, cuda_graphs.py)."""
        if isinstance(self.forward, CompiledDecodeStep):
            self.forward.warm_up(self.prepare, self.block_size)
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()

    def close(self) -> None:
        """Free what the runner holds beside the model and the cache: CUDA graphs and their memory."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None

    @property
    def compiles_decode_steps(self) -> bool:
        """Whether all-decode steps run compiled: asked for, and not turned off by a failure."""
        return isinstance(self.forward, CompiledDecodeStep) and self.forward.off_because is None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Run one step: a token for every sampler of every chunk (ScheduledChunk.samplers), in chunk
        order, and the logprobs asked for."""
        if self.draft is not None:
            with part("speculation: propose", whole=True):
                self.draft.run(chunks)  # its K/V of the step's rows, and the proposals prepare() lays out
        with part("host: prepare"):
            input_ids, batch, wanted = self.prepare(chunks)
        if isinstance(batch, DecodeGraphStep):  # replayed from a CUDA graph
            logits = self.decode_graphs.run(input_ids, batch.layout, batch.positions)  # (S, V)
        else:
            logits = self.forward(input_ids, batch)  # (S + Q, V): one forward over the N tokens of every sequence
        with part("sampling"):
            S = sum(len(c.row_samplers) for c in chunks)
            if not wanted.empty:
                wanted.score(logits)  # raw logprobs, before penalties, temperature and filters
            tokens, accepted = self._sample(chunks, logits[:S])
            if wanted.empty:  # the step's single host sync
                values = (tokens if accepted is None else torch.cat([tokens, accepted])).tolist()
                token_list, sample_lps, prompt_lps, accepted_list = values[:S], [], [], values[S:]
            else:  # still the only sync
                token_list, sample_lps, prompt_lps, accepted_list = wanted.fetch(tokens, accepted)
            out = self._by_sampler(chunks, token_list, sample_lps, prompt_lps)
            if accepted is not None:
                out.num_accepted = _num_accepted(chunks, accepted_list)
            return out

    @staticmethod
    def _sample(chunks: list[ScheduledChunk], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (S, V) of the sampled rows -> a token per row (S,), and for the verify rows (those of
        speculating chunks, in order) whether each proposal was accepted (as 0/1), or None if none."""
        plain = [s for c in chunks if not c.draft for s in c.samplers]  # a fork draws from its parent's row
        if len(plain) == logits.shape[0]:
            return sample(logits, [s.params for s in plain], [s.generator for s in plain], plain), None
        speculating = [c for c in chunks if c.draft]
        rows = VerifyRows.of([c.seq for c in speculating], [c.draft for c in speculating])
        if not plain:  # every row verifies (batch 1, say): no split, no scatter
            with part("speculation: verify"):
                tokens, accepted = verify(logits, rows)
            return tokens, accepted.long()
        is_verify = to_device([bool(c.draft) for c in chunks for _ in c.row_samplers], logits.device)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # (S,)
        tokens[~is_verify] = sample(logits[~is_verify], [s.params for s in plain], [s.generator for s in plain], plain)
        with part("speculation: verify"):
            tokens[is_verify], accepted = verify(logits[is_verify], rows)
        return tokens, accepted.long()

    @staticmethod
    def _by_sampler(chunks, tokens, sample_lps, prompt_lps) -> StepOutput:
        """Hand each sampler the logprobs it asked for, and each chunk its prompt's, in the order
        prepare() laid the rows out."""
        out = StepOutput(tokens)
        sample_lps, prompt_lps = iter(sample_lps), iter(prompt_lps)
        row = 0
        for i, (chunk, rows) in enumerate(zip(chunks, _prompt_rows_per_chunk(chunks))):
            for seq in chunk.row_samplers:
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
        wanted = StepLogprobs(sum(len(c.row_samplers) for c in chunks))
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
            if chunk.draft:  # verify rows: each its own one-query row over the context up to it, batched
                starts += range(first_row, first_row + chunk.num_tokens)
                lens += [1] * chunk.num_tokens
                context_lens += range(start + 1, end + 1)
                tables += [table] * chunk.num_tokens
            else:
                starts.append(first_row)
                lens.append(chunk.num_tokens)
                context_lens.append(end)
                tables.append(table)
            input_ids += seq.token_ids[start : end - len(chunk.draft)] + chunk.draft
            positions += range(start, end)
            slots += [slot_of(table, p, block_size) for p in range(start, end)]
            samplers = chunk.row_samplers  # n rows when n completions fork here; k + 1 when speculating
            rows = range(first_row, first_row + chunk.num_tokens) if chunk.draft else [len(input_ids) - 1] * len(samplers)
            for sampler, row in zip(samplers, rows):
                if sampler.params.logprobs is not None:
                    wanted.sample_rows.append(len(sample_rows))
                    wanted.sample_k = max(wanted.sample_k, sampler.params.logprobs)
                sample_rows.append(row)
        sample_rows += prompt_rows  # the LM head runs on these too, after the sampled rows

        # One host->device copy for all the flat per-token integers.
        N, S = len(input_ids), len(sample_rows)
        flat = to_device(input_ids + positions + slots + sample_rows, self.device)
        ids_t, pos_t, slots_t, sample_t = flat.split([N, N, N, S])
        layout = StepLayout(slots_t, starts, lens, context_lens, tables, block_size, self.kv_cache.null_block)
        if self.decode_graphs is not None and self.decode_graphs.serves(layout, S):
            return ids_t, DecodeGraphStep(layout, pos_t), wanted  # its metadata is built inside the graph
        batch = PagedBatch(pos_t, self.kv_cache, self.attention_backend.build_metadata(layout), sample_t)
        return ids_t, batch, wanted


def _num_accepted(chunks: list[ScheduledChunk], accepted: list[int]) -> dict[int, int]:
    """By speculating chunk: how many of its proposals, from the first, were accepted."""
    out, flags = {}, iter(accepted)
    for i, chunk in enumerate(chunks):
        if chunk.draft:
            row_flags = [next(flags) for _ in range(chunk.num_tokens)]  # the last (bonus) row's is 0
            out[i] = next((j for j, ok in enumerate(row_flags) if not ok), len(chunk.draft))
    return out


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
