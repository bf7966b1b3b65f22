"""Logprobs: the model's own log-probability of each token, computed in the step that produced it.

Two kinds, both asked for through SamplingParams:
- `logprobs=k`: for every generated token, its logprob and the k likeliest tokens at that position;
- `prompt_logprobs=k`: the same for every prompt token after the first (the first has no context).

The values are "raw": log_softmax of the model's logits in fp32, before temperature, penalties,
top-k or top-p (vLLM's default). Only the rows of requests that ask are computed. A step's values
ride with its sampled tokens in the runner's one host sync (`StepLogprobs.packed`, `unpack`).

Prompt logprobs need the logits of every prompt position, not just the last: the LM head reads the
positions a chunk needs, chunk by chunk as prefill goes, and a step holds a capped number of such rows
(`max_logprob_rows`, scorer.py), so no (prompt_len, vocab) tensor ever exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..engine.sampling_params import MAX_LOGPROBS
from ..host_to_device import to_device

LOGIT_ELEMENTS_PER_STEP = 2**24  # prompt-logprob rows x vocab one step may hold (64 MiB in fp32)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its logprob and rank, and the k likeliest tokens (likeliest first)."""

    token_id: int
    logprob: float
    rank: int = 1  # 1 + how many tokens are likelier (vLLM's rank)
    top: tuple[tuple[int, float], ...] = ()  # ((token_id, logprob), ...), k of them


def max_logprob_rows(vocab_size: int) -> int:
    """How many prompt positions one step may run through the LM head for prompt logprobs."""
    return max(1, LOGIT_ELEMENTS_PER_STEP // vocab_size)


def _gathered(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
    """logprobs (R, V), targets (R,) -> [chosen (R,), rank (R,), top values (R*k,), top ids (R*k,)], fp32."""
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)  # (R,)
    rank = (logprobs > chosen[:, None]).sum(dim=-1).float() + 1  # (R,)
    if k == 0:
        return [chosen, rank]
    top_values, top_ids = logprobs.topk(k, dim=-1)  # (R, k) each, likeliest first
    return [chosen, rank, top_values.flatten(), top_ids.float().flatten()]  # ids < 2**24: exact in fp32


@dataclass
class StepLogprobs:
    """Which rows of a step's logits ask for logprobs, and (after `fetch`) their values.

    Sampled rows come first in the logits (S of them), then the prompt rows (Q). `sample_rows` index
    the sampled rows that ask; `prompt_targets` are the tokens whose logprob each prompt row gives."""

    num_sampled: int
    sample_rows: list[int] = field(default_factory=list)  # indices < S of rows that ask
    sample_k: int = 0  # the largest k they ask for (each row's own k is applied on the host)
    prompt_targets: list[int] = field(default_factory=list)  # (Q,) the prompt token each prompt row scores
    prompt_k: int = 0
    _sample_logprobs: torch.Tensor | None = field(default=None, repr=False)  # (R, V), set by score()
    _prompt_logprobs: torch.Tensor | None = field(default=None, repr=False)  # (Q, V)

    @property
    def empty(self) -> bool:
        return not self.sample_rows and not self.prompt_targets

    def score(self, logits: torch.Tensor) -> None:
        """logits (S + Q, V): take the log_softmax of the rows that ask, before sampling can touch them."""
        device, S = logits.device, self.num_sampled
        self._sample_logprobs = self._prompt_logprobs = None
        if self.sample_rows:
            asking = logits[:S]  # (S, V); a copy of just the rows that ask only when some do not
            if len(self.sample_rows) < S:
                asking = asking[to_device(self.sample_rows, device)]  # (R, V)
            self._sample_logprobs = torch.log_softmax(asking, dim=-1, dtype=torch.float32)  # (R, V)
        if self.prompt_targets:
            self._prompt_logprobs = torch.log_softmax(logits[S:], dim=-1, dtype=torch.float32)  # (Q, V)

    def packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the step's one host sync reads back for these rows, given the sampled tokens (S,): each
        asking row's chosen logprob, rank and top k, one flat fp32 tensor (unpack reads it)."""
        device = tokens.device
        parts = []
        if self._sample_logprobs is not None:
            chosen_tokens = tokens[to_device(self.sample_rows, device)]
            parts += _gathered(self._sample_logprobs, chosen_tokens, self.sample_k)
        if self._prompt_logprobs is not None:
            targets = to_device(self.prompt_targets, device)
            parts += _gathered(self._prompt_logprobs, targets, self.prompt_k)
        return torch.cat(parts)

    def unpack(self, values: list[float], tokens: list[int]) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
        """packed()'s values on the host -> (the asking sampled rows' TokenLogprobs, the prompt rows')."""
        sample_lps, rest = _unpack(values, [tokens[r] for r in self.sample_rows], self.sample_k)
        prompt_lps, _ = _unpack(rest, self.prompt_targets, self.prompt_k)
        return sample_lps, prompt_lps


def _unpack(values: list[float], targets: list[int], k: int) -> tuple[list[TokenLogprob], list[float]]:
    """Read back what _gathered packed for len(targets) rows; returns them and what is left."""
    R = len(targets)
    if R == 0:
        return [], values
    chosen, ranks, values = values[:R], values[R : 2 * R], values[2 * R :]
    if k == 0:
        return [TokenLogprob(t, lp, int(r)) for t, lp, r in zip(targets, chosen, ranks)], values
    top_values, top_ids, values = values[: R * k], values[R * k : 2 * R * k], values[2 * R * k :]
    out = []
    for i, (t, lp, r) in enumerate(zip(targets, chosen, ranks)):
        row = slice(i * k, (i + 1) * k)
        top = tuple((int(j), v) for j, v in zip(top_ids[row], top_values[row]))
        out.append(TokenLogprob(t, lp, int(r), top))
    return out, values


def keep_top(entry: TokenLogprob, k: int) -> TokenLogprob:
    """The entry with only its k likeliest tokens (a step computes the largest k any row asked for)."""
    return entry if len(entry.top) == k else replace(entry, top=entry.top[:k])
