"""Responder: every response shape of /v1/completions and /v1/chat/completions, built in one place.

One body (`response`) or a stream's chunks (`first_chunks`, `delta_chunks`, `usage_chunk`), for n
completions of each of a batch of prompts: choice `i * n + j` is completion j of prompt i (vLLM's
numbering). Usage counts each prompt once and every completion's tokens. What a request asks beyond
the text, each choice gets from its feature's helper, made only when asked: the logprobs and the echoed
prompt (ScoredChoices, logprobs_format.py), the tool calls read out of a chat reply (ToolReplies, tools.py),
the usage so far in every chunk of a stream (UsageSoFar, stream_usage.py).
"""

from __future__ import annotations

import time
import uuid

from ..engine.outputs import CompletionDelta, RequestOutput
from ..text.tokenizer import Tokenizer
from .logprobs_format import ScoredChoices
from .requests import ParsedRequest
from .stream_usage import UsageSoFar
from .tools import ToolReplies


def usage(outs: list[tuple[RequestOutput, ...]], score_only: bool = False) -> dict:
    """outs: per prompt, its completions. Each prompt counted once, every completion's tokens (OpenAI's and
    vLLM's rule); none when the request only scores its prompt. cached_tokens: the prompt tokens the prefix
    cache served, as OpenAI reports them."""
    prompt = sum(len(choices[0].prompt_token_ids) for choices in outs)
    completion = 0 if score_only else sum(len(out.token_ids) for choices in outs for out in choices)
    cached = sum(choices[0].num_cached_tokens for choices in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def generate_response(out: RequestOutput) -> dict:
    """/generate's body: minfer's own, plain shape."""
    return {"text": out.text, "finish_reason": out.finish_reason, "usage": usage([(out,)])}


class Responder:
    def __init__(self, model: str, chat: bool, req: ParsedRequest, tokenizer: Tokenizer):
        self.model, self.chat, self.n = model, chat, req.params.n
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.num_choices = len(req.prompts) * self.n
        self.score_only = req.scoring is not None and req.scoring.score_only  # the prompt scored, nothing generated
        scored = req.params.logprobs is not None or req.scoring is not None
        self.scored = ScoredChoices(req, tokenizer, chat, self.num_choices) if scored else None
        calls = req.tools is not None and req.tools.choice != "none"
        self.tools = ToolReplies(req.tools, self.num_choices) if calls else None
        self.usage_so_far = UsageSoFar(req.prompts, self.n, self.score_only) if req.continuous_usage else None

    # ---- one body --------------------------------------------------------------------

    def response(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        """The whole response; outs: per prompt, its n completions."""
        choices = [self._full_choice(i * self.n + out.index, out) for i, prompt in enumerate(outs) for out in prompt]
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage(outs, self.score_only))

    def _full_choice(self, index: int, out: RequestOutput) -> dict:
        finish_reason = "length" if self.score_only else out.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            if self.tools is not None:  # the calls read out of the reply
                message, finish_reason = self.tools.message(out.text, finish_reason)
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = self._choice(out.text, finish_reason, index=index)
        return choice if self.scored is None else self.scored.whole(choice, index, out)

    # ---- a stream --------------------------------------------------------------------

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant's role, once per choice."""
        if not self.chat:
            return []
        chunks = [self._chunk([self._choice("", None, role=True, index=i)]) for i in range(self.num_choices)]
        return chunks if self.usage_so_far is None else self.usage_so_far.openings(chunks)

    def delta_chunks(self, delta: CompletionDelta, prompt: int = 0) -> list[dict]:
        """The chunks for one step's delta of a completion of prompt `prompt`: its text (a delta whose text
        is held back, or a stop token's, adds none: a stream has no empty chunks), and on its last delta
        its final chunk."""
        index = prompt * self.n + delta.index
        chunks = [] if self.scored is None else self._scored_chunks(index, delta)
        if self.tools is not None:
            chunks += self._tool_chunks(index, delta)
        elif delta.text and not self.score_only:
            chunks.append(self._text_chunk(delta.text, index))
        if delta.finish_reason is not None:
            chunks.append(self._final_chunk(delta.finish_reason, index))
        return chunks if self.usage_so_far is None else self.usage_so_far.stamped(chunks, index, delta)

    def _scored_chunks(self, index: int, delta: CompletionDelta) -> list[dict]:
        """A choice's echo, if due (its prompt, the prompt's logprobs); the delta's tokens then wait for the
        chunk that carries their text, which carries their logprobs too."""
        echo = self.scored.echo(self._choice("", None, index=index), index, delta.prompt_logprobs)
        self.scored.hold(index, delta)
        return [] if echo is None else [self._chunk([echo])]

    def _tool_chunks(self, index: int, delta: CompletionDelta) -> list[dict]:
        """What the reply adds to the content, and to its calls, now that this delta is in."""
        text, calls = self.tools.add(index, delta)
        chunks = [self._text_chunk(text, index)] if text else []
        if calls:
            choice = {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk([choice if self.scored is None else self.scored.flush(choice, index, True)]))
        return chunks

    def _text_chunk(self, text: str, index: int) -> dict:
        choice = self._choice(text, None, index=index)
        return self._chunk([choice if self.scored is None else self.scored.flush(choice, index)])

    def _final_chunk(self, finish_reason: str | None, index: int) -> dict:
        """A choice's last chunk: its finish reason, and the logprobs of tokens that showed no text."""
        finish_reason = "length" if self.score_only else finish_reason
        if self.tools is not None:
            finish_reason = self.tools.finish_reason(index, finish_reason)
        choice = self._choice(None, finish_reason, index=index)
        return self._chunk([choice if self.scored is None else self.scored.flush(choice, index, True)])

    def usage_chunk(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        return self._chunk([], usage=usage(outs, self.score_only))

    # ---- the parts ---------------------------------------------------------------------

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _chunk(self, choices: list, **extra) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices, **extra)

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False, index: int = 0) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
