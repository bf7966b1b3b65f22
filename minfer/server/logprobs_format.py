"""The engine's TokenLogprobs in OpenAI's shapes (and vLLM's, for `prompt_logprobs`).

- /v1/completions `logprobs: k`: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry
  per token; `top_logprobs[i]` is {token: logprob} for the k likeliest tokens plus the token itself
  (so up to k + 1 of them, as vLLM has it). With `echo` the prompt's tokens come first, the first of
  them with `null` logprobs: nothing precedes it.
- /v1/chat/completions `logprobs: true, top_logprobs: k`: {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}.
- `prompt_logprobs: k` (vLLM's extension): per prompt token, null for the first, then
  {token_id: {"logprob", "rank", "decoded_token"}}.

ScoredChoices adds them to one response's choices (the Responder builds the choices): each choice's
logprobs and, with `echo`, its prompt ahead of its text; streamed, the logprobs of exactly the tokens
whose text a chunk carries (tokens whose text is held back wait for the next chunk with text, or the
choice's final chunk), and the echo in a choice's first chunk.

A token's text is its own bytes decoded alone; a token that ends mid-character shows U+FFFD there
(tokens that share a string share a `top_logprobs` key, which holds the likeliest one's logprob),
and chat's `bytes` gives its exact bytes. JSON has no -inf: it is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

from ..engine.outputs import CompletionDelta, RequestOutput
from ..scoring.logprobs import TokenLogprob, keep_top
from ..text.text_offsets import TextOffsets
from ..text.tokenizer import Tokenizer
from .requests import ParsedRequest

NO_PROBABILITY = -9999.0  # stands in for -inf, which JSON cannot carry


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_PROBABILITY


class LogprobFormatter:
    """Formats one completion's logprobs; its TextOffsets (text_offsets.py) counts where each token's text
    starts in the choice's text, so a stream's chunks continue each other's `text_offset`."""

    def __init__(self, tokenizer: Tokenizer, specials_shown: bool = False, starts_text: bool = False):
        self.tokenizer = tokenizer
        # skip_special_tokens false: their names are text; starts_text: no prompt text before the completion's
        self.offsets = TextOffsets(tokenizer, specials_shown, starts_text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to the text; a special token (which adds none) shows as its name."""
        return self.tokenizer.shown_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None], k: int, final: bool = True) -> dict:
        """The completions API's logprobs object for these tokens (entries aligned with token_ids), each
        with its k likeliest tokens; `final`: the text ends with them (a stream's chunks but the last: not)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": self.offsets.offsets(token_ids, final)}
        for token_id, entry in zip(token_ids, _trimmed(entries, k)):
            text = self.token_text(token_id)
            out["tokens"].append(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry.logprob))
            top: dict[str, float] = {}
            for t, lp in entry.top:  # likeliest first: tokens that read the same string keep the likeliest's
                top.setdefault(self.token_text(t), _finite(lp))
            top.setdefault(text, _finite(entry.logprob))
            out["top_logprobs"].append(top)
        return out

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        data = self.token_bytes(token_id)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(data)}

    def chat(self, entries: list[TokenLogprob], k: int) -> dict:
        """The chat API's logprobs object for these tokens, each with its k likeliest tokens."""
        content = []
        for entry in _trimmed(entries, k):
            item = self._chat_entry(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in entry.top]
            content.append(item)
        return {"content": content}

    def prompt_logprobs(self, entries: list[TokenLogprob | None], k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs` field: per prompt token, {token_id: {logprob, rank, decoded_token}}."""
        out: list[dict | None] = []
        for entry in _trimmed(entries, k):
            if entry is None:
                out.append(None)
                continue
            ranked = {t: (lp, i + 1) for i, (t, lp) in enumerate(entry.top)}
            ranked.setdefault(entry.token_id, (entry.logprob, entry.rank))
            out.append(
                {
                    str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": self.token_text(t)}
                    for t, (lp, rank) in ranked.items()
                }
            )
        return out


def _trimmed(entries: list[TokenLogprob | None], k: int) -> list[TokenLogprob | None]:
    """Each entry with its k likeliest tokens only (a step computes the largest k any request asked for)."""
    return [None if e is None else keep_top(e, k) for e in entries]


class ScoredChoices:
    """What scoring adds to the choices of one response (`logprobs`; completions' `echo` and
    `prompt_logprobs`), per choice index."""

    def __init__(self, req: ParsedRequest, tokenizer: Tokenizer, chat: bool, num_choices: int):
        self.req, self.tokenizer, self.chat = req, tokenizer, chat
        self.scoring = None if chat else req.scoring  # echo and prompt_logprobs: completions' only
        self.score_only = self.scoring is not None and self.scoring.score_only
        formatted = num_choices if req.params.logprobs is not None else 0  # else only echo or prompt_logprobs
        shown = not req.params.skip_special_tokens
        self.formatters = [LogprobFormatter(tokenizer, shown, self._starts_text(i)) for i in range(formatted)]
        self.pending: list[list] = [[] for _ in range(num_choices)]  # (token id, logprob) awaiting text
        self.ended = [False] * num_choices  # the pending tokens end the choice's text
        self.echoed = [False] * num_choices

    def _starts_text(self, index: int) -> bool:
        """Whether choice `index`'s text is a text's start, its prompt showing none (a lone BOS)."""
        prompt = self.req.prompts[index // self.req.params.n]
        return self.tokenizer.starts_text(prompt, self.req.params.skip_special_tokens)

    def whole(self, choice: dict, index: int, out: RequestOutput) -> dict:
        """A whole choice with its logprobs, and with echo the prompt (and its logprobs) ahead of its text."""
        token_ids, entries = ([], []) if self.score_only else (out.token_ids, out.logprobs or [])
        if self.scoring is None:
            return _with(choice, self._logprobs(index, token_ids, entries))
        # The prompt's tokens first, then the completion's (the formatter counts text_offset on).
        echo_text, echo_logprobs, asked = self._prompt_parts(index, out.prompt_logprobs)
        logprobs = self._logprobs(index, token_ids, entries)
        if echo_logprobs is not None:
            logprobs = {key: echo_logprobs[key] + logprobs[key] for key in logprobs}
        choice["text"] = echo_text + ("" if self.score_only else out.text)
        return _with(choice, logprobs, asked)

    def echo(self, choice: dict, index: int, prompt_logprobs) -> dict | None:
        """A stream's first chunk of a choice with echo or prompt_logprobs: the prompt; else None."""
        if self.scoring is None or self.echoed[index]:
            return None
        self.echoed[index] = True
        text, logprobs, asked = self._prompt_parts(index, prompt_logprobs)
        if not text and logprobs is None and asked is None:  # a prompt with no text (<s> alone) still has tokens
            return None
        choice["text"] = text
        return _with(choice, logprobs, asked)

    def hold(self, index: int, delta: CompletionDelta) -> None:
        """The delta's tokens wait for the chunk that carries their text."""
        if self.formatters and not self.score_only:
            self.pending[index] += zip(delta.token_ids, delta.logprobs or [])
            self.ended[index] = delta.finish_reason is not None

    def flush(self, choice: dict, index: int, only_if_held: bool = False) -> dict:
        """The chunk's choice with the logprobs of the tokens that waited for it (with only_if_held, none
        when none waited). A run of byte tokens open at the end waits on: the detokenizer holds its text until the
        run ends, and only then are its offsets known (a run holding an invalid byte shows a U+FFFD per byte)."""
        if not self.formatters:
            return choice
        pending, ended = self.pending[index], self.ended[index]
        cut = len(pending) if ended else self.formatters[index].offsets.open_run_start([t for t, _ in pending])
        if cut or not only_if_held:
            sent, self.pending[index] = pending[:cut], pending[cut:]
            choice["logprobs"] = self._logprobs(index, [t for t, _ in sent], [e for _, e in sent], ended)
        return choice

    def _logprobs(self, index: int, token_ids: list[int], entries: list, final: bool = True) -> dict | None:
        if not self.formatters:
            return None
        k, fmt = self.req.params.logprobs, self.formatters[index]
        return fmt.chat(entries, k) if self.chat else fmt.completion(token_ids, entries, k, final)

    def _prompt_parts(self, index: int, prompt_logprobs) -> tuple[str, dict | None, list | None]:
        """The echoed prompt: its text, its completions logprobs, and vLLM's prompt_logprobs field."""
        s = self.scoring
        asked = None
        if s.return_prompt_logprobs:
            asked = LogprobFormatter(self.tokenizer).prompt_logprobs(prompt_logprobs, self.req.params.prompt_logprobs)
        if not s.echo:
            return "", None, asked
        prompt = index // self.req.params.n
        text = self.req.prompt_texts[prompt] if self.req.prompt_texts else None
        text = text if text is not None else self.tokenizer.decode(self.req.prompts[prompt])
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(self.req.prompts[prompt])
        logprobs = self._logprobs(index, self.req.prompts[prompt], entries)
        if logprobs is not None:  # the completion's offsets count on from the echoed text's end
            logprobs["text_offset"] = self._prompt_offsets(prompt, text)
            self.formatters[index].offsets.resume_at(len(text))
        return text, logprobs, asked

    def _prompt_offsets(self, prompt: int, text: str) -> list[int]:
        """Where each prompt token starts in the echoed text. A prompt sent as text: the tokenizer's own offsets
        (a special token written in it spans its name; one the tokenizer adds, a BOS, none). Sent as ids (the
        text their decoding, a text's start): counted from their bytes, less the space a SentencePiece decoder
        drops."""
        if self.req.prompt_texts and self.req.prompt_texts[prompt] is not None:
            return prompt_offsets(self.tokenizer, text)
        return TextOffsets(self.tokenizer, starts_text=True).offsets(self.req.prompts[prompt])


def prompt_offsets(tokenizer: Tokenizer, text: str) -> list[int]:
    """Where each token of tokenizer.encode_prompt(text) starts in `text`, in characters: a character split
    over tokens at the character, a token the post-processor adds (a BOS) where it stands, at no width."""
    starts, end = [], 0
    for start, stop in tokenizer.backend.encode(text, add_special_tokens=True).offsets:
        starts.append(end if start == stop else min(start, end))  # a space trim_offsets cut off is the token's
        end = max(end, stop)
    return starts


def _with(choice: dict, logprobs, prompt_logprobs=None) -> dict:
    choice["logprobs"] = logprobs
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice
