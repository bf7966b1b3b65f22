"""What the engine hands out: RequestOutput, a finished completion, and CompletionDelta, what a
completion produced since the last one was asked for."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A finished request, as returned by OnlineScheduler.pop_responses and LLM.generate."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, a stop token included
    text: str  # generated text, stop strings and stop tokens excluded
    finish_reason: str | None  # "stop" or "length"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (at its first admission)
    # Tokens its re-admissions after preemption found in the prefix cache and did not recompute: its prompt's and
    # its generated ones, summed over its preemptions. Work the cache spared, not usage: it may exceed the prompt.
    num_recompute_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0  # time.perf_counter() values, for latency metrics
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Filled by scoring/ where the request asks: one entry per generated token, and one per prompt token
    # (the first None: nothing precedes it), as vLLM's RequestOutput has them.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    index: int = 0  # which of the request's n completions this is


@dataclass(frozen=True)
class CompletionDelta:
    """What one completion of a request produced since its last delta (OnlineScheduler.get_new_outputs):
    the server's worker sends one after every step that sampled a token for it. Its token ids, and its
    texts, concatenated over a request's deltas, are the RequestOutput's."""

    index: int  # which of the request's n completions (SamplingParams.n)
    token_ids: list[int]  # sampled since the last delta, a stop token included (as in RequestOutput)
    text: str  # the text added since, less a tail held back while it might still become a stop string
    finish_reason: str | None = None  # set on the completion's last delta: "stop" or "length"
    logprobs: list | None = None  # one per token id, for a request that asks (scoring/)
    prompt_logprobs: list | None = None  # on a completion's first delta, if asked
