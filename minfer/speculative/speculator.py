"""The Speculator: which running sequence proposes how many tokens this step, and what came of it.

The rule is per request, from its own settings and its own recent acceptance; the batch enters only for
requests without a seed. (A seeded request's tokens depend on nothing else that runs in any case:
verification spends one draw of its generator per emitted token, as plain decoding does; verify.py.)
- A sequence speculates once it is decoding (its first token sampled), and
  never past its max_tokens: k is cut to the tokens it may still produce, less the one every step
  makes anyway, and to the step's token budget.
- The proposer must find something: an n-gram proposer with no match proposes nothing, and the step
  runs a plain decode row for it (a draft model always proposes).
- Proposals that keep failing cost k extra rows for nothing. Each sequence keeps a moving average of
  the share of its proposals accepted; when it falls below FAIL_SHARE (plus, with a draft model, what a
  proposal's draft forward costs in target forwards), the sequence pauses speculation
  for a cool-down of output tokens that doubles each time it fails again (up to MAX_COOLDOWN), and
  starts afresh with a hopeful average after it.
- Unseeded requests speculate only while at most MAX_BATCH sequences run. At batch 1 a step reads
  every weight for one row, and k more rows cost next to nothing; at batch 16 the step is compute-bound
  and k + 1 rows per sequence cost their FLOPs (minfer-tiny, one thread: a plain step 4.3 ms, k = 4
  verify rows for all 16 10.2 ms, about the same as plain at batch 1). Seeded requests ignore the
  batch, and speculate at any batch size.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ..engine.sequence import Sequence
from .ngram import NgramProposer

AVERAGE_WEIGHT = 0.3  # weight of the newest step in the moving average of the accepted share
FAIL_SHARE = 0.1  # below this average share, proposals are not paying for their rows
MAX_FAIL_SHARE = 0.9  # the most a draft's cost raises FAIL_SHARE to
MAX_BATCH = 4  # unseeded requests speculate only while at most this many sequences run
FIRST_COOLDOWN = 8  # output tokens without speculation after the first failure ...
MAX_COOLDOWN = 128  # ... doubling on each further failure, up to this


@dataclass
class SpecStats:
    """Counters since the engine started, with vLLM's meanings (spec_decode_num_*_total)."""

    num_drafts: int = 0  # verifications: steps in which a sequence checked proposals
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # proposals accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: proposals at position j accepted
    # [n]: verifications that emitted n tokens (accepted + the target's own), n in 1 .. k + 1
    accepted_length_counts: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """For OnlineScheduler.stats() (and so /metrics): vLLM's spec_decode names."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "spec_decode_accepted_length_counts": list(self.accepted_length_counts),
        }

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emits on average: accepted proposals plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Record:
    share: float = 1.0  # moving average of the share of proposals accepted
    resume_at: int = 0  # output length at which speculation resumes
    cooldown: int = FIRST_COOLDOWN


class Speculator:
    def __init__(self, num_speculative_tokens: int, ngram_min: int | None, ngram_max: int | None, draft=None):
        self.k = num_speculative_tokens
        # A draft model (draft.py) proposes k placeholders here and fills them before the step runs.
        self.proposer = draft or NgramProposer(ngram_min, ngram_max)
        # A proposal that costs a draft forward must be kept more often to pay for itself: a verification
        # emits 1 + share * k tokens for 1 + cost * k forwards. Capped, so a draft that is always right
        # (one that costs as much as the model, as in tests) still speculates.
        self.fail_share = min(FAIL_SHARE + getattr(self.proposer, "cost_per_proposal", 0.0), MAX_FAIL_SHARE)
        k = num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * k, accepted_length_counts=[0] * (k + 2))
        self._records: weakref.WeakKeyDictionary[Sequence, _Record] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, budget: int, num_running: int) -> list[int]:
        """The tokens seq proposes to verify this step, for a step that has `budget` rows left besides
        its own decode row and runs `num_running` sequences; [] for a plain decode. Pure: the batcher
        may ask again after a preemption."""
        if seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
            return []
        if seq.params.seed is None and num_running > MAX_BATCH:
            return []
        k = min(self.k, seq.params.max_tokens - seq.num_output_tokens - 1, budget)
        record = self._records.get(seq)
        if k < 1 or (record is not None and seq.num_output_tokens < record.resume_at):
            return []
        return self.proposer.propose(seq.token_ids, k, key=seq)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verification's outcome: count it, and update the sequence's average (and cool-down)."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        stats.accepted_length_counts[num_accepted + 1] += 1
        record = self._records.setdefault(seq, _Record())
        record.share += AVERAGE_WEIGHT * (num_accepted / num_proposed - record.share)
        if record.share < self.fail_share:
            record.resume_at = seq.num_output_tokens + record.cooldown
            record.cooldown = min(2 * record.cooldown, MAX_COOLDOWN)
            record.share = min(1.0, self.fail_share + 0.4)  # after the pause, a fresh chance
        elif num_accepted == num_proposed:
            record.cooldown = FIRST_COOLDOWN  # paying again: a later failure pauses it briefly
