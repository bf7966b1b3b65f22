"""The scheduler's record of one request: its choices (SamplingParams.n completions, one by default, each a
sequence with its text and timeline), and what it hands out: a CompletionDelta per step, a RequestOutput
per choice at the end. The request is finished when all its choices are."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..text.text_stream import TextStream
from .outputs import CompletionDelta, RequestOutput
from .sequence import Sequence


@dataclass
class Choice:
    """One completion of a request: its sequence, its text, its timeline."""

    seq: Sequence
    text: TextStream
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() values
    finish_time: float | None = None
    num_streamed_tokens: int = 0  # output tokens new_output has handed out

    def add_token(self, token: int, now: float) -> bool:
        """Record a sampled token in the sequence and the text. True if it finished the choice."""
        seq = self.seq
        seq.append_token(token)  # finishes it on a stop token or at max_tokens
        self.token_times.append(now)
        # A stop token's text is shown only with include_stop_str_in_output. Stop strings count once the
        # output is past min_tokens (vLLM's rule); one ends the choice too, and wins over "length".
        check = seq.num_output_tokens > seq.params.min_tokens
        if seq.finish_reason != "stop" or seq.params.include_stop_str_in_output:
            if self.text.add_token(token, check) or (seq.is_finished and self.text.flush(check)):
                seq.finish("stop")
        else:  # the stop token adds no text, but what the detokenizer held back before it comes out
            self.text.flush(check)
        if seq.is_finished:
            self.finish_time = now
        return seq.is_finished

    def end(self, reason: str, now: float) -> None:
        """Finish the choice before its tokens did (a feature's verdict), with the text it has."""
        if not self.seq.is_finished:
            self.text.flush(check_stop=False)
            self.finish_time = now
        self.seq.finish(reason)

    def new_output(self) -> CompletionDelta | None:
        """The token ids sampled since the last call and the text they add (less a tail that might still
        become a stop string); None if nothing was sampled since."""
        seq, streamed = self.seq, self.num_streamed_tokens
        token_ids = seq.token_ids[seq.num_prompt_tokens + streamed :]
        if not token_ids:
            return None
        self.num_streamed_tokens += len(token_ids)
        text = self.text.pop_new_text(finished=seq.is_finished)
        logprobs = None if seq.logprobs is None else seq.logprobs[streamed : streamed + len(token_ids)]
        prompt_logprobs = seq.prompt_logprobs if streamed == 0 else None  # on the first delta
        return CompletionDelta(seq.index, token_ids, text, seq.finish_reason, logprobs, prompt_logprobs)

    def output(self, request_id: str, arrival_time: float) -> RequestOutput:
        seq = self.seq
        out = RequestOutput(
            request_id=request_id, index=seq.index, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids, text=self.text.text, finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens, num_recompute_cached_tokens=seq.num_recompute_cached_tokens,
            num_preemptions=seq.num_preemptions, arrival_time=arrival_time,
            first_token_time=self.token_times[0] if self.token_times else None, token_times=self.token_times,
            finish_time=self.finish_time, logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs,
        )
        self.let_go()  # the output holds the logprobs now
        return out

    def let_go(self) -> None:
        """The sequence drops its logprobs (scoring/), handed out or discarded: the last step's chunks hold the
        sequence while the engine idles, and a 1000-token prompt's prompt_logprobs=20 are 2.7 MB."""
        self.seq.logprobs = self.seq.prompt_logprobs = None


@dataclass
class Request:
    """The registry's entry for one request: its choices (n of them) and when it arrived."""

    choices: list[Choice]
    arrival_time: float  # time.perf_counter()
    num_steps: int = 0  # engine steps that ran it (prefill chunks and decodes)

    @property
    def seq(self) -> Sequence:
        """The first choice's sequence."""
        return self.choices[0].seq

    @property
    def is_finished(self) -> bool:
        return all(c.seq.is_finished for c in self.choices)
