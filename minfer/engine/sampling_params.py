"""SamplingParams: what one request asks of the sampler, each field checked by a rule declared as data.

Every field has one `Rule` in RULES: the values it takes, and the sentence that says so when a value
is bad (an InvalidParameter naming the field, which the server turns into a 400 with that `param`).
The server's request parser (server/requests.py) maps JSON fields onto these and lets this class judge
them: a rule is written once. Fields follow vLLM's semantics (docs/sampling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple

from ..errors import InvalidParameter, is_int
from .structured_outputs_params import StructuredOutputsParams

MAX_LOGPROBS = 20  # the most top tokens a request may ask for per position (OpenAI's limit)
# Below it a temperature is greedy, as in vLLM: dividing by it leaves only the top token (or ties) a chance,
# and far enough below, fp32 logits divided by it overflow to inf, from which nothing can be drawn.
GREEDY_TEMPERATURE = 1e-5


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Rule(NamedTuple):
    ok: Callable[[Any], bool]
    must: str  # what a good value is: "{name} must be {must}, got ..."
    convert: Callable[[Any], Any] | None = None  # the value as the sampler keeps it


def _between(low: float, high: float) -> Rule:
    return Rule(lambda v: _number(v) and low <= v <= high, f"a number in [{low:g}, {high:g}]", float)


def _stop(v) -> bool:
    items = [v] if isinstance(v, str) else v
    return isinstance(items, (list, tuple)) and all(isinstance(s, str) and s for s in items)


def _token_ids(v) -> bool:
    return isinstance(v, (list, tuple)) and all(is_int(i) and i >= 0 for i in v)


def _logit_bias(v) -> bool:
    return isinstance(v, dict) and all(is_int(t) and t >= 0 and _number(b) and -100 <= b <= 100 for t, b in v.items())


NUM_LOGPROBS = Rule(lambda v: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
                    f"None or an int in [0, {MAX_LOGPROBS}]")
BOOL = Rule(lambda v: isinstance(v, bool), "a bool")
RULES: dict[str, Rule] = {
    # None, as in vLLM: as many as the context (and the KV cache) leave after the prompt; check_limits counts them
    "max_tokens": Rule(lambda v: v is None or (is_int(v) and v >= 1), "None (up to the context) or an int >= 1"),
    "temperature": Rule(lambda v: _number(v) and v >= 0, "a number >= 0", float),  # 0: greedy
    # 0: off; -1 too, as in vLLM (its scripts pass it)
    "top_k": Rule(lambda v: is_int(v) and v >= -1, "an int >= 0 (or -1, off as 0 is)", lambda v: max(v, 0)),
    "top_p": Rule(lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", float),  # 1: off
    "seed": Rule(lambda v: v is None or is_int(v), "None or an int"),
    "stop": Rule(lambda v: v is None or _stop(v), "None, a non-empty str or a list of non-empty str",
                 lambda v: None if v is None else [v] if isinstance(v, str) else list(v)),
    "stop_token_ids": Rule(lambda v: v is None or _token_ids(v),
                           "None or a list of ints >= 0", lambda v: None if v is None else list(v)),
    "ignore_eos": BOOL,
    "logprobs": NUM_LOGPROBS,
    "prompt_logprobs": NUM_LOGPROBS,
    "n": Rule(lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "presence_penalty": _between(-2, 2),
    "frequency_penalty": _between(-2, 2),
    "repetition_penalty": Rule(lambda v: _number(v) and v > 0, "a number > 0", float),
    "min_p": _between(0, 1),
    "logit_bias": Rule(lambda v: v is None or _logit_bias(v), "None or {token id >= 0: a number in [-100, 100]}",
                       lambda v: {t: float(b) for t, b in v.items()} or None if v is not None else None),
    "min_tokens": Rule(lambda v: is_int(v) and v >= 0, "an int in [0, max_tokens]"),
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "structured_outputs": Rule(lambda v: v is None or isinstance(v, StructuredOutputsParams),
                               "None or a StructuredOutputsParams"),
}


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context (an int once the engine has checked the request)
    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 means disabled
    top_p: float = 1.0  # 1.0 means disabled
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str] or None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # per generated token: its logprob and the k likeliest (scoring/)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1  # completions of the one prompt (seeded: choice i uses seed + i); parallel_sampling/ shares its blocks
    # The controls below follow vLLM's semantics (logits_processors.py applies them).
    presence_penalty: float = 0.0  # [-2, 2]: minus this for every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    # > 0: a token seen in prompt or output has its logit divided (where > 0) or multiplied (where <= 0)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the likeliest one
    logit_bias: dict[int, float] | None = None  # {token id: bias in [-100, 100]} added to the logits
    min_tokens: int = 0  # no stop token, EOS or stop string can end the output before this many tokens
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # special tokens add no text
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match (structured/)

    def __post_init__(self) -> None:
        """Check every field by its rule; a bad one raises InvalidParameter naming it."""
        for f in fields(self):
            value, rule = getattr(self, f.name), RULES[f.name]
            if value is f.default:  # a field left at its default is good as it is
                continue
            if not rule.ok(value):
                raise InvalidParameter(f.name, f"{f.name} must be {rule.must}, got {value!r}")
            if rule.convert is not None:
                setattr(self, f.name, rule.convert(value))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                                   f"got {self.min_tokens!r}")

    @property
    def uses_logits_controls(self) -> bool:
        """Whether any control that reshapes the logits before the draw is on (min_p apart)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def uses_sampling_controls(self) -> bool:
        """Whether anything beyond the temperature shapes the draw: the logits controls, min_p, top-k, top-p."""
        return self.uses_logits_controls or self.min_p > 0 or self.top_k > 0 or self.top_p < 1

    @property
    def wants_logprobs(self) -> bool:
        """Whether the request asks for logprobs of its tokens or of its prompt (scoring/)."""
        return self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
