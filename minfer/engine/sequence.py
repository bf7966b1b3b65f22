"""One request's engine state: its tokens, its KV blocks, and whether it is done (plus RequestOutput,
what a finished request becomes, and CompletionDelta, what it produced in one step).

A Sequence is WAITING (queued, or preempted and waiting to be recomputed), RUNNING
(it holds KV blocks and is scheduled every step) or FINISHED. Its tokens are the
prompt followed by everything generated; `num_computed_tokens` counts how many
of them already have their keys and values in the cache. Prefill, chunked
prefill, decode and recompute-after-preemption are all the same operation:
compute the tokens from `num_computed_tokens` up to the end.

Its text (detokenizing, stop strings, streaming) lives in text_stream.py: the
engine decides on token ids alone, except that a stop string may end a request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable

import torch

from ..scoring.logprobs import TokenLogprob
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A finished request, as returned by OnlineScheduler.pop_response and LLM.generate."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, a stop token included
    text: str  # generated text, stop strings and stop tokens excluded
    finish_reason: str | None  # "stop" or "length"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    arrival_time: float = 0.0  # time.perf_counter() values, for latency metrics
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # With SamplingParams.logprobs: one TokenLogprob per generated token. With prompt_logprobs: one per
    # prompt token, the first None (nothing precedes it), as vLLM's RequestOutput has them.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's n completions this is


@dataclass(frozen=True)
class CompletionDelta:
    """What one completion of a request produced since its last delta (OnlineScheduler.get_new_output):
    the server's worker sends one after every step that sampled a token for it. Its token ids, and its
    texts, concatenated over a request's deltas, are the RequestOutput's."""

    index: int  # which of the request's n completions (SamplingParams.n)
    token_ids: list[int]  # sampled since the last delta, a stop token included (as in RequestOutput)
    text: str  # the text added since, less a tail held back while it might still become a stop string
    finish_reason: str | None = None  # set on the completion's last delta: "stop" or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token id, for a request that asks
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a completion's first delta, if asked


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),  # every id that ends the sequence (chat models have several)
        generator: torch.Generator | None = None,
        index: int = 0,
    ):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        # The other completions, not yet started: when this one's prefill ends, they fork from it, sharing
        # its blocks, and each samples its first token from the same logits (ContinuousBatcher.fork).
        self.forks: list[Sequence] = []
        self.params = params
        self.generator = generator  # the request's own RNG when it has a seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at admission
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []  # one per output token, when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprob] = []  # for prompt tokens 1, 2, ...: entry p from position p
        self.stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        # What min_tokens holds back (sampling forbids them): as vLLM, the EOS ids even with ignore_eos.
        self.min_tokens_stop_ids = sorted(set(params.stop_token_ids or ()) | set(eos_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt positions whose logprobs were asked for and are not computed yet."""
        if self.params.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a sampled token; a stop token or reaching max_tokens finishes the sequence."""
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids and self.num_output_tokens >= self.params.min_tokens:
            self.finish("stop")
        elif self.num_output_tokens >= self.params.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        """Mark it done: "stop" (a stop token or stop string) or "length" (max_tokens)."""
        self.finish_reason = reason
        self.status = Status.FINISHED


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of `seq` this step."""

    seq: Sequence
    start: int
    num_tokens: int  # with a draft: the sequence's last token and the proposals
    draft: list[int] = field(default_factory=list)  # speculative decoding: tokens proposed after the last

    @property
    def produces_token(self) -> bool:
        """A chunk that reaches the sequence's last token produces the next token."""
        return self.start + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def row_samplers(self) -> list[Sequence]:
        """The sequence each sampled row of this chunk draws for: its samplers, one row each, or a
        speculating sequence once per verified row (its last token and every proposal)."""
        return [self.seq] * self.num_tokens if self.draft else self.samplers

    @property
    def samplers(self) -> list[Sequence]:
        """The sequences that draw a token from this chunk's last row: its own, and at the end of a prefill
        with n > 1 the forks that start from it."""
        if not self.produces_token:
            return []
        return [self.seq, *self.seq.forks] if self.seq.forks else [self.seq]
