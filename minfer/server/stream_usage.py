"""A stream's usage: `stream_options` read, and vLLM's continuous_usage_stats, where every chunk of a stream
carries its choice's usage so far (the usage of the whole request, include_usage's, is the last chunk's)."""

from __future__ import annotations

from collections.abc import Callable

from ..engine.outputs import CompletionDelta
from .api_errors import invalid

USAGE_OPTIONS = ("include_usage", "continuous_usage_stats")  # continuous_usage_stats: vLLM's


def read_usage_options(options: dict, stream: bool, log_unread: Callable[[str], None]) -> tuple[bool, bool]:
    """stream_options -> (include_usage, continuous_usage): as in vLLM, usage in every chunk only with
    include_usage too. An option it does not read is logged (OpenAI's include_obfuscation, say: it asks
    nothing of the text)."""
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    for key in options:
        if key not in USAGE_OPTIONS:
            log_unread(f"stream_options.{key}")
    flags = [options.get(key) for key in USAGE_OPTIONS]
    for key, flag in zip(USAGE_OPTIONS, flags):
        if flag is not None and not isinstance(flag, bool):
            raise invalid(f"stream_options.{key}", f"'{key}' must be a boolean", "invalid_type")
    return bool(flags[0]), bool(flags[0] and flags[1])


class UsageSoFar:
    """Per choice (`i * n + j`: completion j of prompt i), its prompt's tokens and those generated so far."""

    def __init__(self, prompts: list[list[int]], n: int, score_only: bool):
        self.prompt_lengths, self.n = [len(p) for p in prompts], n
        self.score_only = score_only  # the prompt scored, nothing generated: its completion counts none
        self.generated = [0] * (len(prompts) * n)

    def openings(self, chunks: list[dict]) -> list[dict]:
        """A chat stream's first chunks, chunk i choice i's, each with its usage (nothing generated yet)."""
        return [self.stamped([chunk], i)[0] for i, chunk in enumerate(chunks)]

    def stamped(self, chunks: list[dict], index: int, delta: CompletionDelta | None = None) -> list[dict]:
        """The chunks of choice `index`, each with its usage, the tokens of `delta` (the step's) counted."""
        if delta is not None and not self.score_only:
            self.generated[index] += len(delta.token_ids)
        prompt, completion = self.prompt_lengths[index // self.n], self.generated[index]
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        return [chunk | {"usage": usage} for chunk in chunks]
