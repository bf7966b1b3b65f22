"""Responses with several choices (a batch of prompts, n completions each) and with logprobs, echo and
prompt logprobs.

`ScoringResponder` extends openai_api.Responder. Choice `i * n + j` is completion j of prompt i (vLLM's
numbering); usage counts each prompt once and every completion's tokens, and each choice carries the
logprobs its request asked for (logprobs_format.py has the shapes).
Streamed, each chunk carries the logprobs of exactly the tokens whose text it carries: tokens whose
text is still held back (a possible stop string) wait for the next chunk with text, or the choice's
final chunk. With `echo`, a choice's first chunk is its prompt (and the prompt's logprobs).
"""

from __future__ import annotations

from ..scoring.logprobs import TokenLogprob, keep_top
from ..engine.sequence import CompletionDelta, RequestOutput
from ..text.tokenizer import Tokenizer
from .logprobs_format import LogprobFormatter
from .openai_api import ParsedRequest, Responder


def _trim(entries: list[TokenLogprob | None], k: int) -> list[TokenLogprob | None]:
    return [None if e is None else keep_top(e, k) for e in entries]


class ScoringResponder(Responder):
    def __init__(self, model: str, chat: bool, req: ParsedRequest, tokenizer: Tokenizer):
        super().__init__(model, chat, req.params.n)
        self.req = req
        self.tokenizer = tokenizer
        self.scoring = None if chat else req.scoring
        choices = len(req.prompts) * self.n  # by choice index: prompt index * n + completion index
        self.formatters = [LogprobFormatter(tokenizer) for _ in range(choices)]
        self.pending: list[list[tuple[int, TokenLogprob]]] = [[] for _ in range(choices)]  # awaiting text
        self.echoed = [False] * choices

    @property
    def wants_logprobs(self) -> bool:
        return self.req.params.logprobs is not None

    def _echo_text(self, prompt: int) -> str:
        text = self.req.prompt_texts[prompt]
        return text if text is not None else self.tokenizer.decode(self.req.prompts[prompt])

    def _logprobs(self, index: int, token_ids: list[int], entries: list) -> dict | None:
        if not self.wants_logprobs:
            return None
        k = self.req.params.logprobs
        fmt = self.formatters[index]
        return fmt.chat(_trim(entries, k)) if self.chat else fmt.completion(token_ids, _trim(entries, k))

    def _prompt_parts(self, index: int, prompt_logprobs) -> tuple[str, dict | None, list | None]:
        """The echoed prompt: its text, its completions logprobs, and vLLM's prompt_logprobs field."""
        s = self.scoring
        if s is None:
            return "", None, None
        asked = None
        if s.return_prompt_logprobs:
            asked = self.formatters[index].prompt_logprobs(_trim(prompt_logprobs, self.req.params.prompt_logprobs))
        if not s.echo:
            return "", None, asked
        prompt = index // self.n
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(self.req.prompts[prompt])
        return self._echo_text(prompt), self._logprobs(index, self.req.prompts[prompt], entries), asked

    def _with(self, choice: dict, logprobs, prompt_logprobs=None) -> dict:
        choice["logprobs"] = logprobs
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    # ---- one body --------------------------------------------------------------------

    def response_all(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        """outs: per prompt, its n completions."""
        choices = [self._full_choice(i * self.n + out.index, out) for i, prompt in enumerate(outs) for out in prompt]
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=self.usage_all(outs))

    def _full_choice(self, index: int, out: RequestOutput) -> dict:
        score_only = self.scoring is not None and self.scoring.score_only
        token_ids, entries = ([], []) if score_only else (out.token_ids, out.logprobs or [])
        finish_reason = "length" if score_only else out.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return self._with(choice, self._logprobs(index, token_ids, entries))
        echo_text, echo_logprobs, asked = self._prompt_parts(index, out.prompt_logprobs)
        logprobs = self._logprobs(index, token_ids, entries)
        if echo_logprobs is not None:  # the prompt's tokens first, then the completion's
            logprobs = {key: echo_logprobs[key] + logprobs[key] for key in logprobs}
        text = echo_text + ("" if score_only else out.text)
        return self._with(self._choice(text, finish_reason, index=index), logprobs, asked)

    def usage_all(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        """Each prompt counted once, every completion's tokens (OpenAI's and vLLM's rule)."""
        prompt = sum(len(p[0].prompt_token_ids) for p in outs)
        score_only = self.scoring is not None and self.scoring.score_only
        completion = 0 if score_only else sum(len(o.token_ids) for p in outs for o in p)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- a stream --------------------------------------------------------------------

    def first_chunks_all(self) -> list[dict]:
        if not self.chat:
            return []
        choices = len(self.req.prompts) * self.n
        return [self._chunk([self._choice("", None, role=True, index=i)]) for i in range(choices)]

    def delta_chunks(self, delta: CompletionDelta, prompt: int) -> list[dict]:
        """The chunks for one step's delta of a completion of prompt `prompt`: its echo first, if due,
        then its text, and on its last delta its final chunk."""
        index = prompt * self.n + delta.index
        chunks = self._delta_text_chunks(delta, index)
        if delta.finish_reason is not None:
            chunks.append(self.final_chunk_for(delta.finish_reason, index))
        return chunks

    def _delta_text_chunks(self, delta: CompletionDelta, index: int) -> list[dict]:
        chunks = []
        if not self.echoed[index]:
            self.echoed[index] = True
            text, logprobs, asked = self._prompt_parts(index, delta.prompt_logprobs)
            if text or asked is not None:
                chunks.append(self._chunk([self._with(self._choice(text, None, index=index), logprobs, asked)]))
        if self.scoring is not None and self.scoring.score_only:
            return chunks
        if self.wants_logprobs:
            self.pending[index] += zip(delta.token_ids, delta.logprobs or [])
        if delta.text:
            chunks.append(self._chunk([self._with(self._choice(delta.text, None, index=index), self._flush(index))]))
        return chunks

    def _flush(self, index: int) -> dict | None:
        pending, self.pending[index] = self.pending[index], []
        return self._logprobs(index, [t for t, _ in pending], [e for _, e in pending])

    def final_chunk_for(self, finish_reason: str | None, index: int) -> dict:
        """A choice's last chunk: its finish reason, and the logprobs of tokens that showed no text."""
        if self.scoring is not None and self.scoring.score_only:
            finish_reason = "length"
        logprobs = self._flush(index) if self.pending[index] else None
        return self._chunk([self._with(self._choice(None, finish_reason, index=index), logprobs)])

    def usage_chunk_all(self, outs: list[RequestOutput]) -> dict:
        return self._chunk([], usage=self.usage_all(outs))
