"""One request's engine state: its tokens, its KV blocks, and whether it is done; and ScheduledChunk,
the part of it one step computes.

A Sequence is WAITING (queued, or preempted and waiting to be recomputed), RUNNING (it holds KV blocks and
is scheduled every step) or FINISHED. Its tokens are the prompt followed by everything generated;
`num_computed_tokens` counts how many of them already have their keys and values in the cache. Prefill,
chunked prefill, decode and recompute-after-preemption are all the same operation: compute the tokens from
`num_computed_tokens` up to the end.

Its text (detokenizing, stop strings, streaming) lives in text_stream.py: the engine decides on token ids
alone, except that a stop string may end a request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    # What a feature room sets on the sequences of a request that asks for it; these defaults otherwise.
    logprobs: list | None = None  # scoring/: one entry per generated token
    prompt_logprobs: list | None = None  # scoring/: one per prompt token
    max_cached_tokens: int | None = None  # scoring/: how far a prefix-cache hit may reach (None: any length)
    seats = 1  # parallel_sampling/: of max_num_seqs it holds: itself, and sequences that will start from it

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: Iterable[int] = (), generator: torch.Generator | None = None, index: int = 0):
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.generator = generator  # the request's own RNG when it has a seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at its first admission
        self.num_recompute_cached_tokens = 0  # tokens re-admissions after a preemption found cached (outputs too)
        self.num_preemptions = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_token_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)  # every id that ends the sequence (chat models have several)
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
    """Compute tokens [start, start + num_tokens) of `seq` this step: one forward over them, one query
    row each, every row attending to the sequence's context up to itself."""

    seq: Sequence
    start: int
    num_tokens: int
    # The sequences that draw a token from the chunk's last row: seq itself when the chunk reaches its last
    # token, and any that start from it there (parallel_sampling/).
    samplers: list[Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samplers and self.start + self.num_tokens == self.seq.num_tokens:
            self.samplers = [self.seq]

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def input_ids(self) -> list[int]:
        """The chunk's token ids, one per row."""
        return self.seq.token_ids[self.start : self.end]

    def query_runs(self) -> list[tuple[int, int]]:
        """(first row, rows) of each run of rows that attend as one query block: here, the whole chunk."""
        return [(0, self.num_tokens)]

    @property
    def num_rows(self) -> int:
        """Rows the chunk adds to the step's forward."""
        return self.num_tokens

    def sampled_rows(self) -> list[tuple[int, Sequence]]:
        """(row within the chunk, the sequence it draws for) of every row the LM head samples."""
        return [(self.num_tokens - 1, s) for s in self.samplers]

    def emitted(self, tokens: list[int]) -> list[tuple[Sequence, list[int]]]:
        """What each sampler emits, given the tokens drawn at sampled_rows(): one token each."""
        return [(seq, [token]) for (_, seq), token in zip(self.sampled_rows(), tokens)]
