"""The engine's TokenLogprobs in OpenAI's shapes (and vLLM's, for `prompt_logprobs`).

- /v1/completions `logprobs: k`: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry
  per token; `top_logprobs[i]` is {token: logprob} for the k likeliest tokens plus the token itself
  (so up to k + 1 of them, as vLLM has it). With `echo` the prompt's tokens come first, the first of
  them with `null` logprobs: nothing precedes it.
- /v1/chat/completions `logprobs: true, top_logprobs: k`: {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}.
- `prompt_logprobs: k` (vLLM's extension): per prompt token, null for the first, then
  {token_id: {"logprob", "rank", "decoded_token"}}.

A token's text is its own bytes decoded alone; a token that ends mid-character shows U+FFFD there,
and chat's `bytes` gives its exact bytes. JSON has no -inf: it is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

from ..scoring.logprobs import TokenLogprob, keep_top
from ..text.tokenizer import Tokenizer

NO_PROBABILITY = -9999.0  # stands in for -inf, which JSON cannot carry


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NO_PROBABILITY


class LogprobFormatter:
    """Formats one completion's logprobs; it remembers the text offset reached, so a stream's chunks
    continue each other's `text_offset`."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text_offset = 0

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to the text; a special token (which adds none) shows as its name."""
        return self.tokenizer.token_bytes[token_id] or (self.tokenizer.id_to_token(token_id) or "").encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None], k: int) -> dict:
        """The completions API's logprobs object for these tokens (entries aligned with token_ids), each
        with its k likeliest tokens."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, _trimmed(entries, k)):
            text = self.token_text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry.logprob))
            top = {self.token_text(t): _finite(lp) for t, lp in entry.top}
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
