"""Speculative decoding in the engine: where proposals enter a step, and what the step keeps of them.

The core calls a `Speculation` at four lines (engine/features.py names them):
- `propose`, as the policy schedules a running sequence (ContinuousBatcher.schedule): a decode that
  speculates (speculator.py says which, and how many tokens) becomes a `VerifyChunk`: its last token and
  k proposals, k + 1 one-query rows, for which the policy finds blocks and budget as for any chunk;
- `fill`, once the step is scheduled: a draft model fills the step's proposals, in k forwards batched
  over the sequences (draft.py);
- `sample`, in the runner: plain rows are sampled as the core samples them, verify rows by the
  acceptance rule (verify.py); which proposals were accepted rides in the step's one host sync (`read`);
- `settle`, after the tokens are recorded: a verification emitted its accepted proposals and one more
  token (fewer if a stop came first, or a proposal completed the sequence's grammar:
  structured/ ends its tokens there); their K/V stay, the rejected ones' slots are written over later
  and blocks that held only rejected proposals go back (the batcher's `computed` and `shrink`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.continuous_batcher import ContinuousBatcher
from ..engine.sampling import sample
from ..engine.sequence import ScheduledChunk, Sequence
from ..engine.step_stats import StepStats
from ..host_to_device import to_device
from ..step_parts import part
from .speculator import Speculator
from .verify import VerifyRows, verify


@dataclass
class VerifyChunk(ScheduledChunk):
    """A decode with proposals: the sequence's last token, then `draft`, one query row each, every row
    sampled for the sequence. num_tokens stays 1: the proposals count once kept (Speculation.settle)."""

    draft: list[int] = field(default_factory=list)
    num_accepted: int = 0  # proposals accepted, from the first (read back after sampling)

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft)

    def input_ids(self) -> list[int]:
        return [self.seq.token_ids[self.start], *self.draft]

    def query_runs(self) -> list[tuple[int, int]]:
        return [(j, 1) for j in range(1 + len(self.draft))]  # each row attends up to itself

    def sampled_rows(self) -> list[tuple[int, Sequence]]:
        return [(j, self.seq) for j in range(1 + len(self.draft))]

    def emitted(self, tokens: list[int]) -> list[tuple[Sequence, list[int]]]:
        return [(self.seq, tokens[: self.num_accepted + 1])]  # the accepted proposals and the target's own token


class Speculation:
    def __init__(self, speculator: Speculator, draft=None):
        self.speculator = speculator  # when a sequence speculates and how much; the proposer; the counters
        self.draft = draft  # a draft model's DraftProposer (draft.py), or None for n-gram proposals

    def propose(self, chunk: ScheduledChunk, budget: int, num_running: int) -> ScheduledChunk:
        """The chunk, or a VerifyChunk in its place if its sequence decodes and proposes tokens this step."""
        seq = chunk.seq
        if chunk.num_tokens != 1 or chunk.samplers != [seq]:
            return chunk
        with part("speculation: propose"):
            draft = self.speculator.propose(seq, budget - 1, num_running)
        return VerifyChunk(seq, chunk.start, 1, draft=draft) if draft else chunk

    def fill(self, chunks: list[ScheduledChunk]) -> None:
        """A draft model's proposals, placeholders until now, computed for the whole step."""
        if self.draft is not None:
            with part("speculation: propose", whole=True):
                self.draft.run(chunks)

    def sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (S, V) of the sampled rows -> a token per row (S,), and for the verify rows (those of
        VerifyChunks, in order) whether each proposal was accepted (as 0/1), or None if none verifies."""
        speculating = [c for c in chunks if isinstance(c, VerifyChunk)]
        plain = [s for c in chunks if not isinstance(c, VerifyChunk) for _, s in c.sampled_rows()]
        if not speculating:
            return sample(logits, [s.params for s in plain], [s.generator for s in plain], plain), None
        rows = VerifyRows.of([c.seq for c in speculating], [c.draft for c in speculating])
        if not plain:  # every row verifies (batch 1, say): no split, no scatter
            with part("speculation: verify"):
                tokens, accepted = verify(logits, rows)
            return tokens, accepted.long()
        is_verify = to_device([isinstance(c, VerifyChunk) for c in chunks for _ in c.sampled_rows()], logits.device)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # (S,)
        tokens[~is_verify] = sample(logits[~is_verify], [s.params for s in plain], [s.generator for s in plain], plain)
        with part("speculation: verify"):
            tokens[is_verify], accepted = verify(logits[is_verify], rows)
        return tokens, accepted.long()

    def read(self, chunks: list[ScheduledChunk], accepted: list[float]) -> None:
        """Each VerifyChunk's accepted proposals, from the first: its rows' flags up to the first 0."""
        flags = iter(accepted)
        for chunk in chunks:
            if isinstance(chunk, VerifyChunk):
                row_flags = [next(flags) for _ in range(1 + len(chunk.draft))]  # the last (bonus) row's is 0
                chunk.num_accepted = next((j for j, ok in enumerate(row_flags) if not ok), len(chunk.draft))

    def settle(self, chunks: list[ScheduledChunk], batcher: ContinuousBatcher, step: StepStats) -> None:
        """After the step's tokens are recorded: count each verification, keep the K/V of the proposals now
        in the sequence's tokens, give back blocks that held only rejected ones."""
        for chunk in chunks:
            if not isinstance(chunk, VerifyChunk):
                continue
            seq, k, accepted = chunk.seq, len(chunk.draft), chunk.num_accepted
            num_emitted = seq.num_tokens - chunk.end  # accepted + 1, or fewer if a stop ended it
            self.speculator.record(seq, k, accepted)
            step.num_sampled += num_emitted - 1  # the step counted one token per sampler
            step.num_draft_tokens += k
            step.num_accepted_tokens += accepted
            if not seq.is_finished:  # a finished sequence's blocks are free already
                batcher.computed(seq, min(num_emitted, accepted))
                batcher.shrink(seq)

    def stats(self) -> dict:
        return self.speculator.stats.as_dict()
