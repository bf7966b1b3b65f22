"""One request's life in the engine: its tokens, its KV blocks, its text, and when to stop.

A Sequence is WAITING (queued, or preempted and waiting to be recomputed), RUNNING
(it holds KV blocks and is scheduled every step) or FINISHED. Its tokens are the
prompt followed by everything generated; `num_computed_tokens` counts how many
of them already have their keys and values in the cache. Prefill, chunked
prefill, decode and recompute-after-preemption are all the same operation:
compute the tokens from `num_computed_tokens` up to the end.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer


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
    arrival_time: float = 0.0  # time.perf_counter() values, for benchmarks
    first_scheduled_time: float | None = None  # when its first engine step began
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: list[int],  # every id that ends the sequence (chat models have several)
        generator: torch.Generator | None,
    ):
        self.request_id = request_id
        self.params = params
        self.generator = generator  # the request's own RNG when it has a seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks registered so far, in order
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        self.detokenizer = detokenizer
        self.text = ""
        self.num_streamed_chars = 0  # how much of `text` get_new_text has handed out
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

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

    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        if token_id in self.stop_ids:
            self._finish("stop")
            return
        self._add_text(self.detokenizer.add(token_id))
        if self.finish_reason is None and self.num_output_tokens >= self.params.max_tokens:
            self._finish("length")

    def _add_text(self, piece: str) -> None:
        if not piece:
            return
        self.text += piece
        if self.params.stop:
            # Only the tail can hold a stop string that was not there before this piece.
            longest = max(map(len, self.params.stop))
            search_from = max(0, len(self.text) - len(piece) - longest + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.params.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]  # cut the stop string and all after it
                self._finish("stop")

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None and reason != "stop":
            self._add_text(self.detokenizer.flush())  # an unfinished UTF-8 tail, as decode renders it
        if self.finish_reason is None:  # _add_text may have found a stop string first
            self.finish_reason = reason
        self.status = Status.FINISHED
        self.finish_time = time.perf_counter()

    def stable_text_length(self) -> int:
        """How much of `text` can be streamed now: all of it once finished; otherwise hold back
        a tail that could still become a stop string (it would have to be cut)."""
        if self.is_finished or not self.params.stop:
            return len(self.text)
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return len(self.text) - held

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            token_times=list(self.token_times),
            finish_time=self.finish_time,
        )
