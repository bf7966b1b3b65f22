"""Scoring in the engine: which rows of a step are scored, and where their logprobs go.

The core calls a `Scoring` at four lines (engine/features.py names them):
- `add`: a new request's sequences. Those that ask keep their logprobs in `seq.logprobs` (one per
  output token) and `seq.prompt_logprobs` (None for the first prompt token, then one per token);
- `cap_rows`: after the policy has chosen the step's chunks, prompt positions to be scored are cut to
  a bounded number a step (`max_rows`), so no (prompt_len, vocab) tensor ever exists;
- `rows`: while the runner lays the step out, the prompt positions a chunk scores join the LM head's
  rows, after the sampled ones; the returned StepScores reads the logprobs off the logits before
  sampling touches them, and its values ride in the step's one host sync (logprobs.py);
- `record`: after the step's tokens are recorded, each sequence keeps the logprobs of the tokens it
  emitted (the prompt positions' are kept as soon as the step's values are read back).

A prefix-cache hit must not skip prompt positions still to be scored: `seq.max_cached_tokens` follows
what has been scored (a preempted request may reuse the blocks of what it scored already), and once the
whole prompt is, any hit may serve (a recompute finds its generated tokens' blocks too).
"""

from __future__ import annotations

import weakref

import torch

from ..engine.model_runner import StepRows
from ..engine.sequence import ScheduledChunk, Sequence
from ..host_to_device import to_device
from .logprobs import StepLogprobs, TokenLogprob, keep_top, max_logprob_rows


class Scoring:
    def __init__(self, vocab_size: int):
        self.max_rows = max_logprob_rows(vocab_size)  # prompt positions one step may score
        self.live: weakref.WeakSet[Sequence] = weakref.WeakSet()  # sequences that keep logprobs, while they live
        self.last: StepScores | None = None  # the step being recorded

    def add(self, seqs: list[Sequence]) -> None:
        """A new request's sequences, which asked for logprobs."""
        self.live.update(seqs)
        for seq in seqs:
            if seq.params.logprobs is not None:
                seq.logprobs = []
            if seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # the first prompt token: nothing precedes it
                seq.max_cached_tokens = max_cached_tokens(seq)

    def cap_rows(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks, those still scoring their prompt cut so that a step scores at most max_rows positions
        (a chunk cut to nothing waits, holding its blocks, for the next step)."""
        left, out = self.max_rows, []
        for chunk in chunks:
            if missing_prompt_logprobs(chunk.seq) > 0:
                n = min(chunk.num_tokens, left)
                left -= n
                if n == 0:
                    continue
                if n < chunk.num_tokens:
                    chunk = ScheduledChunk(chunk.seq, chunk.start, n)
            out.append(chunk)
        return out

    def rows(self, chunks: list[ScheduledChunk], rows: StepRows, device: torch.device) -> StepScores | None:
        """The step's rows that ask: sampled rows whose sequence wants logprobs, and the prompt positions
        each chunk scores, which join rows.sample_rows (after the sampled ones). None if no row asks."""
        num_sampled = rows.sample_rows.shape[0]
        scores = StepScores(StepLogprobs(num_sampled), chunks)
        wanted, first_row, sampled = scores.wanted, 0, 0
        prompt_rows: list[int] = []
        for chunk in chunks:
            for _, seq in chunk.sampled_rows():
                if seq.logprobs is not None:
                    wanted.sample_rows.append(sampled)
                    wanted.sample_k = max(wanted.sample_k, seq.params.logprobs)
                sampled += 1
            positions = prompt_positions(chunk)
            for p in positions:  # prompt position p gives the logprob of prompt token p + 1
                prompt_rows.append(first_row + p - chunk.start)
                wanted.prompt_targets.append(chunk.seq.token_ids[p + 1])
            if positions:
                wanted.prompt_k = max(wanted.prompt_k, chunk.seq.params.prompt_logprobs)
            scores.positions.append(positions)
            first_row += chunk.num_rows
        self.last = None if wanted.empty else scores
        if prompt_rows:
            rows.sample_rows = torch.cat([rows.sample_rows, to_device(prompt_rows, device)])
        return self.last

    def record(self, chunks: list[ScheduledChunk]) -> None:
        """Each sampler keeps the logprobs of the tokens this step gave it (a stop may have ended it
        before the last of a speculating sequence's rows)."""
        scores, self.last = self.last, None
        if scores is None:
            return
        entries = iter(scores.sample_logprobs)
        for chunk in chunks:
            rows: dict[int, tuple[Sequence, list[TokenLogprob]]] = {}  # by sampler: its rows' logprobs in order
            for _, seq in chunk.sampled_rows():
                if seq.logprobs is not None:
                    rows.setdefault(id(seq), (seq, []))[1].append(next(entries))
            for seq, row_entries in rows.values():
                kept = seq.num_output_tokens - len(seq.logprobs)
                seq.logprobs += [keep_top(e, seq.params.logprobs) for e in row_entries[:kept]]



class StepScores:
    """One step's scored rows (StepLogprobs) and, by chunk, the prompt positions it scores."""

    def __init__(self, wanted: StepLogprobs, chunks: list[ScheduledChunk]):
        self.wanted = wanted
        self.chunks = chunks
        self.positions: list[range] = []  # by chunk
        self.sample_logprobs: list[TokenLogprob] = []  # filled by read(), in wanted.sample_rows' order

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (S + Q, V) -> the sampled rows' (S, V), their logprobs and the prompt rows' taken first."""
        self.wanted.score(logits)
        return logits[: self.wanted.num_sampled]

    def tensors(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """What to read back in the step's sync, given the sampled tokens (S,)."""
        return [self.wanted.packed(tokens)]

    def read(self, values: list[float], tokens: list[int]) -> None:
        """The values read back: the prompt positions' go to their sequences now, the sampled rows' wait
        for Scoring.record (which knows how many tokens each sampler kept)."""
        self.sample_logprobs, prompt_lps = self.wanted.unpack(values, tokens)
        entries = iter(prompt_lps)
        for chunk, positions in zip(self.chunks, self.positions):
            if positions:
                seq = chunk.seq
                seq.prompt_logprobs += [keep_top(next(entries), seq.params.prompt_logprobs) for _ in positions]
                seq.max_cached_tokens = max_cached_tokens(seq)


def missing_prompt_logprobs(seq: Sequence) -> int:
    """Prompt positions whose logprobs were asked for and are not computed yet."""
    if seq.prompt_logprobs is None:
        return 0
    return seq.num_prompt_tokens - len(seq.prompt_logprobs)


def max_cached_tokens(seq: Sequence) -> int | None:
    """How far a prefix hit may reach for seq: over the prompt positions scored so far; anywhere (None) once
    every one is, as for a request that asks for none."""
    return len(seq.prompt_logprobs) - 1 if missing_prompt_logprobs(seq) else None


def prompt_positions(chunk: ScheduledChunk) -> range:
    """The prompt positions the chunk computes whose logits give a prompt token's logprob (position p scores
    token p + 1) not yet recorded (a recompute after a preemption skips what was)."""
    seq = chunk.seq
    if seq.prompt_logprobs is None:
        return range(0)
    first = max(chunk.start, len(seq.prompt_logprobs) - 1)
    return range(first, min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1))
