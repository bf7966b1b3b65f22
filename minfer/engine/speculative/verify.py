"""The acceptance rule: which of a sequence's proposed tokens the target model keeps, and what it adds.

A speculating sequence with proposals d_0 .. d_{k-1} contributes k + 1 rows to the step's logits: row j
is the target's distribution for the token after the sequence plus d_0 .. d_{j-1}. Each row gets the
sampling controls (logit_bias, min_tokens, penalties) with that history, exactly as it would have one
token at a time. Then, row by row:
- greedy: d_j is accepted if it is the row's argmax; the first row that disagrees gives its argmax;
- sampling (the proposal is a point mass at d_j, as an n-gram's is): accept d_j with probability
  p_j(d_j); at the first rejection draw from the residual, p_j with d_j removed and renormalised. That
  is the standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023) with q a point mass:
  the kept token is distributed exactly as p_j. With every proposal accepted, row k draws a bonus token.
So a step emits the accepted prefix and one more token: 1 to k + 1 tokens.

Every row draws two uniforms, accept or not, from the request's own generator when it has a seed: what a
seeded request gets depends on its own tokens only, never on what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..logits_processors import apply_logits_controls, apply_min_p
from ..sampling import SamplingParams, apply_top_k_top_p, draw_from


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


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(R, V) controlled logits -> (R, V) the probabilities sample() draws from: temperature, min_p, top-k
    and top-p applied, renormalised."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temps[:, None]  # (R, V)
    if any(p.min_p > 0 for p in params):
        scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], device=device))
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def _uniforms(rows: VerifyRows, index: list[int], device) -> torch.Tensor:
    """(r, 2) uniforms for the sampled rows: an acceptance test and a draw; a seeded request's from its
    own generator."""
    u = torch.rand(len(index), 2, device=device)
    for i, r in enumerate(index):
        g = rows.generators[r]
        if g is not None:
            u[i] = torch.rand(2, device=device, generator=g)
    return u


def verify(logits: torch.Tensor, rows: VerifyRows) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) of the verify rows -> (tokens (R,), accepted (R,) bool). Row j's token is d_j where
    accepted, else the target's own choice there (its argmax, or a residual or bonus draw): so a
    sequence's output is d_0 .. d_{a-1} and the token of row a, a being its first row not accepted."""
    device = logits.device
    logits = logits.float()  # (R, V)
    if any(p.uses_logits_controls for p in rows.params):
        logits = apply_logits_controls(logits, rows.params, rows.histories)
    drafts = torch.tensor(rows.drafts, device=device)  # (R,)
    has_draft = drafts >= 0
    drafts_or_0 = drafts.clamp(min=0)
    tokens = logits.argmax(dim=-1)  # (R,): the greedy rows' choice; sampled rows overwrite it
    accepted = has_draft & (tokens == drafts)
    sampled = [r for r, p in enumerate(rows.params) if not p.is_greedy]
    if sampled:
        index = torch.tensor(sampled, device=device)
        probs = target_probs(logits[index], [rows.params[r] for r in sampled])  # (r, V)
        u = _uniforms(rows, sampled, device)  # (r, 2)
        d, drafted = drafts_or_0[index], has_draft[index]
        p_draft = probs.gather(1, d[:, None]).squeeze(1)  # (r,)
        accepted[index] = drafted & (u[:, 0] < p_draft)
        residual = probs.clone()
        residual[drafted, d[drafted]] = 0.0  # p with the proposal removed (draw_from renormalises)
        empty = residual.sum(dim=-1) <= 0  # p was all on the proposal, which is then always accepted
        residual[empty] = probs[empty]
        tokens[index] = draw_from(residual, u[:, 1])
    return torch.where(accepted, drafts, tokens), accepted
