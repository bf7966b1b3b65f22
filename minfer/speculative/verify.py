"""The acceptance rule: which of a sequence's proposed tokens the target model keeps, and what it adds.

A speculating sequence with proposals d_0 .. d_{k-1} contributes k + 1 rows to the step's logits: row j
is the target's distribution for the token after the sequence plus d_0 .. d_{j-1}. Each row gets the
sampling controls (logit_bias, min_tokens, penalties) with that history, exactly as it would have one
token at a time. Then, row by row:
- greedy: d_j is accepted if it is the row's argmax; the first row that disagrees gives its argmax;
- sampling: the row's own draw, as plain decoding would make it (the same sampler, the next uniform
  of the request's generator); d_j is accepted where the draw is d_j. That keeps d_j with probability
  p_j(d_j), and at the first rejection the token is distributed as p_j with d_j removed and
  renormalised: the standard rejection-sampling rule for a point-mass proposal (an n-gram's, a draft
  model's greedy one; Leviathan et al. 2023; Chen et al. 2023), its test and its draw sharing one
  uniform. With every proposal accepted, row k draws a bonus token.
So a step emits the accepted prefix and one more token: 1 to k + 1 tokens.

A seeded request spends one uniform of its own generator per token it emits (rows after its first
rejection give theirs back): its tokens are the ones plain decoding would give it, however many rows
a step verified, so they never depend on what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..host_to_device import to_device
from ..engine.sampling import sample_with
from ..engine.sampling_params import SamplingParams


@dataclass
class DraftHistory:
    """A row's token history as the logits controls read it: the sequence as if d_0 .. d_{j-1} were kept."""

    token_ids: list[int]
    num_prompt_tokens: int
    min_tokens_stop_ids: list[int]


@dataclass
class VerifyRows:
    """The k + 1 rows of every speculating sequence of a step, flattened in order."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    histories: list[DraftHistory | None]
    drafts: list[int]  # the proposal each row checks; -1 on a sequence's last (bonus) row

    @classmethod
    def of(cls, seqs, proposals: list[list[int]]) -> VerifyRows:
        rows = cls([], [], [], [])
        for seq, draft in zip(seqs, proposals):
            for j in range(len(draft) + 1):
                rows.params.append(seq.params)
                rows.generators.append(seq.generator)
                history = None  # read only by the logits controls: built only for rows that use them
                if seq.params.uses_logits_controls:
                    history = DraftHistory(seq.token_ids + draft[:j], seq.num_prompt_tokens, seq.min_tokens_stop_ids)
                rows.histories.append(history)
                rows.drafts.append(draft[j] if j < len(draft) else -1)
        return rows


def verify(logits: torch.Tensor, rows: VerifyRows) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) of the verify rows -> (tokens (R,), accepted (R,) bool). Row j's token is the target's
    own choice there, exactly as plain decoding would make it: sampling.sample's argmax or draw, on the
    next uniform of the request's generator. d_j is accepted where that choice is d_j. So a sequence's
    output is d_0 .. d_{a-1} and the token of row a, a being its first row not accepted, and it used one
    uniform per token it emitted, as one token at a time would have (see _Uniforms)."""
    uniforms = _Uniforms(rows, logits.device)
    tokens = sample_with(logits, rows.params, uniforms.draw, rows.histories)  # (R,)
    drafts = to_device(rows.drafts, logits.device)  # (R,)
    accepted = (drafts >= 0) & (tokens == drafts)
    uniforms.give_back_unused(accepted.tolist())
    return tokens, accepted


class _Uniforms:
    """The rows' uniforms, drawn as plain decoding draws them (sampling._uniforms: a seeded request's from
    its own generator, one per token). Rows after a sequence's first rejection emit nothing: their draws
    are given back (the generator is rewound), so what a seeded request gets never depends on how many
    rows it verified, and so never on the batch (which may cut k, or preempt it into a plain step)."""

    def __init__(self, rows: VerifyRows, device):
        self.rows, self.device = rows, device
        self.states: dict[int, torch.Tensor] = {}  # row -> its generator's state before the row's draw

    def draw(self) -> torch.Tensor:
        rows = self.rows
        u = torch.rand(len(rows.params), device=self.device)  # (R,): unseeded rows use the global RNG
        for r, (g, p) in enumerate(zip(rows.generators, rows.params)):
            if g is not None and not p.is_greedy:
                # A sequence's rows share its generator: each state is taken between two of its draws.
                self.states[r] = g.get_state()
                u[r] = torch.rand(1, device=self.device, generator=g)[0]
        return u

    def give_back_unused(self, accepted: list[bool]) -> None:
        """Rewind each seeded generator to just after its sequence's last emitted row: the first row not
        accepted (rows of a sequence are consecutive; its last, the bonus row, is never accepted)."""
        rows = self.rows
        for r in self.states:
            first_of_seq = r == 0 or rows.drafts[r - 1] < 0
            if not first_of_seq:
                continue
            last = r
            while accepted[last]:
                last += 1  # an accepted row is never a sequence's last
            after = last + 1  # the state after the last emitted row's draw
            if after in self.states and rows.drafts[last] >= 0:  # a later row of this sequence drew too
                rows.generators[r].set_state(self.states[after])
