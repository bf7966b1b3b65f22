"""Responder: every response shape of /v1/completions and /v1/chat/completions, built in one place.

One body (`response`) or a stream's chunks (`first_chunks`, `delta_chunks`, `usage_chunk`), for n
completions of each of a batch of prompts: choice `i * n + j` is completion j of prompt i (vLLM's
numbering). Usage counts each prompt once and every completion's tokens. Each choice carries the
logprobs its request asked for (logprobs_format.py writes OpenAI's shapes). Streamed, a chunk carries
the logprobs of exactly the tokens whose text it carries: tokens whose text is still held back (a
possible stop string) wait for the next chunk with text, or the choice's final chunk. With `echo`, a
choice's first chunk is its prompt (and the prompt's logprobs).

A chat request with tools (and tool_choice other than "none") has its replies read for tool calls
(tool_calls.py): a call comes back in `message.tool_calls`, with finish_reason "tool_calls"; streamed, as
OpenAI's tool-call deltas (index, id and name, then fragments of the arguments), content that could
still open a call held back until it cannot.
"""

from __future__ import annotations

import time
import uuid

from ..engine.outputs import CompletionDelta, RequestOutput
from ..text.tokenizer import Tokenizer
from .logprobs_format import LogprobFormatter
from .requests import ParsedRequest
from .tool_calls import CallStream, call_id, read


def usage(outs: list[RequestOutput]) -> dict:
    """One prompt's usage: the prompt counted once, every completion's tokens (OpenAI's and vLLM's rule)."""
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def generate_response(out: RequestOutput) -> dict:
    """/generate's body: minfer's own, plain shape."""
    return {"text": out.text, "finish_reason": out.finish_reason, "usage": usage([out])}


class Responder:
    def __init__(self, model: str, chat: bool, req: ParsedRequest, tokenizer: Tokenizer):
        self.model, self.chat, self.req, self.tokenizer = model, chat, req, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = req.params.n
        self.scoring = None if chat else req.scoring
        self.score_only = self.scoring is not None and self.scoring.score_only
        choices = len(req.prompts) * self.n  # by choice index: prompt index * n + completion index
        self.formatters = [LogprobFormatter(tokenizer) for _ in range(choices)] if req.params.logprobs is not None else []
        self.pending: list[list] = [[] for _ in range(choices)]  # (token id, logprob) awaiting text
        self.echoed = [False] * choices
        tools = req.tools if chat and req.tools is not None and req.tools.choice != "none" else None
        self.tools, self.limit = tools, None if tools is None or tools.parallel else 1
        self.calls = []  # per choice, with tools: its reply read for calls as it streams
        if tools is not None:
            names = set(tools.names)
            self.calls = [CallStream(tools.format, names, tools.enforced, self.limit) for _ in range(choices)]

    # ---- one body --------------------------------------------------------------------

    def response(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        """The whole response; outs: per prompt, its n completions."""
        choices = [self._full_choice(i * self.n + out.index, out) for i, prompt in enumerate(outs) for out in prompt]
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=self.usage(outs))

    def _full_choice(self, index: int, out: RequestOutput) -> dict:
        token_ids, entries = ([], []) if self.score_only else (out.token_ids, out.logprobs or [])
        finish_reason = "length" if self.score_only else out.finish_reason
        if self.chat:
            message, finish_reason = self._message(out.text, finish_reason)
            choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
            return self._with(choice, self._logprobs(index, token_ids, entries))
        echo_text, echo_logprobs, asked = self._prompt_parts(index, out.prompt_logprobs)
        logprobs = self._logprobs(index, token_ids, entries)
        if echo_logprobs is not None:  # the prompt's tokens first, then the completion's
            logprobs = {key: echo_logprobs[key] + logprobs[key] for key in logprobs}
        text = echo_text + ("" if self.score_only else out.text)
        return self._with(self._choice(text, finish_reason, index=index), logprobs, asked)

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole chat reply: its content, and with tools the calls read out of it."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        reading = read(self.tools.format, text, set(self.tools.names), final=True, partial=self.tools.enforced)
        calls = [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in reading.calls[: self.limit]]
        if not calls:
            return {"role": "assistant", "content": reading.content}, finish_reason
        message = {"role": "assistant", "content": reading.content or None, "tool_calls": calls}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def usage(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        """Each prompt counted once, every completion's tokens."""
        counts = [usage(list(prompt)) for prompt in outs]
        prompt = sum(c["prompt_tokens"] for c in counts)
        completion = 0 if self.score_only else sum(c["completion_tokens"] for c in counts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- a stream --------------------------------------------------------------------

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant's role, once per choice."""
        if not self.chat:
            return []
        return [self._chunk([self._choice("", None, role=True, index=i)]) for i in range(len(self.pending))]

    def delta_chunks(self, delta: CompletionDelta, prompt: int = 0) -> list[dict]:
        """The chunks for one step's delta of a completion of prompt `prompt`: its echo first, if due, then
        its text (a delta whose text is held back, or a stop token's, adds none: a stream has no empty
        chunks), and on its last delta its final chunk."""
        index = prompt * self.n + delta.index
        chunks = []
        if self.scoring is not None and not self.echoed[index]:  # scoring: the prompt's echo and logprobs
            chunks += self._echo_chunks(index, delta.prompt_logprobs)
        if self.formatters and not self.score_only:  # the tokens' logprobs wait for a chunk with their text
            self.pending[index] += zip(delta.token_ids, delta.logprobs or [])
        if self.calls:  # tools: the reply read for calls as it streams
            chunks += self._tool_chunks(index, delta)
        elif delta.text and not self.score_only:
            chunks.append(self._chunk([self._with(self._choice(delta.text, None, index=index), self._flush(index))]))
        if delta.finish_reason is not None:
            chunks.append(self._final_chunk(delta.finish_reason, index))
        return chunks

    def _echo_chunks(self, index: int, prompt_logprobs) -> list[dict]:
        self.echoed[index] = True
        text, logprobs, asked = self._prompt_parts(index, prompt_logprobs)
        if not text and asked is None:
            return []
        return [self._chunk([self._with(self._choice(text, None, index=index), logprobs, asked)])]

    def _tool_chunks(self, index: int, delta: CompletionDelta) -> list[dict]:
        """What the reply adds to the content, and to its calls, now that this delta is in."""
        text, calls = self.calls[index].add(delta.text, final=delta.finish_reason is not None)
        chunks = []
        if text:
            chunks.append(self._chunk([self._with(self._choice(text, None, index=index), self._flush(index))]))
        if calls:
            choice = {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
            chunks.append(self._chunk([self._with(choice, self._flush(index) if self.pending[index] else None)]))
        return chunks

    def _final_chunk(self, finish_reason: str | None, index: int) -> dict:
        """A choice's last chunk: its finish reason, and the logprobs of tokens that showed no text."""
        finish_reason = "length" if self.score_only else finish_reason
        if self.calls and self.calls[index].called and finish_reason == "stop":
            finish_reason = "tool_calls"
        logprobs = self._flush(index) if self.pending[index] else None
        return self._chunk([self._with(self._choice(None, finish_reason, index=index), logprobs)])

    def usage_chunk(self, outs: list[tuple[RequestOutput, ...]]) -> dict:
        return self._chunk([], usage=self.usage(outs))

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

    @staticmethod
    def _with(choice: dict, logprobs, prompt_logprobs=None) -> dict:
        choice["logprobs"] = logprobs
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def _logprobs(self, index: int, token_ids: list[int], entries: list) -> dict | None:
        if not self.formatters:
            return None
        k, fmt = self.req.params.logprobs, self.formatters[index]
        return fmt.chat(entries, k) if self.chat else fmt.completion(token_ids, entries, k)

    def _flush(self, index: int) -> dict | None:
        if not self.formatters:
            return None
        pending, self.pending[index] = self.pending[index], []
        return self._logprobs(index, [t for t, _ in pending], [e for _, e in pending])

    def _prompt_parts(self, index: int, prompt_logprobs) -> tuple[str, dict | None, list | None]:
        """The echoed prompt: its text, its completions logprobs, and vLLM's prompt_logprobs field."""
        s = self.scoring
        if s is None:
            return "", None, None
        asked = None
        if s.return_prompt_logprobs:
            asked = LogprobFormatter(self.tokenizer).prompt_logprobs(prompt_logprobs, self.req.params.prompt_logprobs)
        if not s.echo:
            return "", None, asked
        prompt = index // self.n
        text = self.req.prompt_texts[prompt] if self.req.prompt_texts else None
        text = text if text is not None else self.tokenizer.decode(self.req.prompts[prompt])
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(self.req.prompts[prompt])
        return text, self._logprobs(index, self.req.prompts[prompt], entries), asked
