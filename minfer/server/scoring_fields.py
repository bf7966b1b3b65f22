"""The request fields for scoring text: logprobs, echo, prompt_logprobs, and batched prompts.

- /v1/completions: `logprobs: k` (an int, 0-20), `echo: bool`, vLLM's `prompt_logprobs: k`, and
  `prompt` as a string, a list of token ids, or a list of either (one choice per prompt). With `echo`
  and `logprobs`, the prompt's own logprobs are computed too (engine `prompt_logprobs`), as
  lm-evaluation-harness needs; `max_tokens: 0` with `echo` scores a prompt without generating.
- /v1/chat/completions: `logprobs: bool` and `top_logprobs: k` (0-20, only with logprobs).

Each check raises a 400 naming the field, the prompt's index included for a bad prompt in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..scoring.logprobs import MAX_LOGPROBS
from ..errors import invalid, is_int
from ..text.tokenizer import Tokenizer


def _num_logprobs(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise invalid(name, f"'{name}' must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}", "invalid_type")
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid(name, f"'{name}' must be from 0 to {MAX_LOGPROBS}, got {value}")
    return value


@dataclass
class CompletionScoring:
    """What a completions request asks of scoring."""

    logprobs: int | None  # k likeliest per token; None: no logprobs in the response
    echo: bool  # the prompt's text (and, with logprobs, its logprobs) ahead of the completion
    prompt_logprobs: int | None  # what the engine computes for the prompt (echo + logprobs, or asked)
    return_prompt_logprobs: bool  # vLLM's `prompt_logprobs` field in each choice
    score_only: bool  # max_tokens 0 with echo: nothing is generated


def completion_scoring(body: dict) -> CompletionScoring:
    logprobs = _num_logprobs(body, "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", f"'echo' must be a boolean, got {echo!r}", "invalid_type")
    echo = bool(echo)
    asked = _num_logprobs(body, "prompt_logprobs")
    prompt_logprobs = max(asked or 0, logprobs) if echo and logprobs is not None else asked
    max_tokens = body.get("max_tokens")
    score_only = is_int(max_tokens) and max_tokens == 0
    if score_only and not echo:
        raise invalid("max_tokens", "'max_tokens' may be 0 only with 'echo': true (to score the prompt)")
    return CompletionScoring(logprobs, echo, prompt_logprobs, asked is not None, score_only)


def chat_logprobs(body: dict) -> int | None:
    """k for a chat request's logprobs (0: the tokens' own logprobs only), or None if not asked."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", f"'logprobs' must be a boolean, got {wanted!r}", "invalid_type")
    top = _num_logprobs(body, "top_logprobs")
    if top is not None and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


def completion_prompts(prompt, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """`prompt` as a batch: its token ids and its text (None where it came as ids), one per prompt.
    A string, a list of token ids, or a non-empty list of strings or of token-id lists."""
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompt = [prompt]  # one prompt
    if not isinstance(prompt, list):
        raise invalid("prompt", f"'prompt' must be a string or a list, got {type(prompt).__name__}", "invalid_type")
    if not prompt:
        raise invalid("prompt", "'prompt' is an empty list: give at least one prompt")
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise invalid(
            "prompt",
            "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists; "
            "a list may not mix them",
            "invalid_type",
        )
    ids, texts = [], []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids.append(tokenizer.encode_prompt(p))
            texts.append(p)
        elif all(is_int(t) for t in p):
            ids.append(list(p))
            texts.append(None)
        else:
            raise invalid(f"prompt[{i}]", f"'prompt[{i}]' must be a list of token ids", "invalid_type")
    return ids, texts
