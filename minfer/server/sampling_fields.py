"""A request's sampling fields -> SamplingParams: OpenAI's and vLLM's names, JSON's shapes.

SamplingParams checks every value itself (engine/sampling.py: ranges, types, min_tokens <= max_tokens)
and the scheduler checks what needs the model (logit_bias ids in the vocabulary, n against the batch);
each raises InvalidParameter naming the field, which becomes the 400. What is left here is what JSON
and the two APIs add: null means "the default", logit_bias keys arrive as strings, `top_k: -1` is
vLLM's "off", and `best_of` is only accepted where it changes nothing (best_of == n).

The fields, with vLLM's semantics (docs/sampling.md says what each does):
OpenAI's  temperature, top_p, n, seed, stop, presence_penalty, frequency_penalty, logit_bias, max_tokens;
vLLM's    top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
          include_stop_str_in_output, skip_special_tokens.
Fields of either API that minfer does not implement are request_fields.py's to refuse.
"""

from __future__ import annotations

from ..engine.sampling import SamplingParams
from ..errors import invalid, is_int

# request field -> (SamplingParams field, the value null stands for)
FIELDS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 0),
    "min_p": ("min_p", 0.0),
    "seed": ("seed", None),
    "stop": ("stop", None),
    "stop_token_ids": ("stop_token_ids", None),
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_tokens": ("min_tokens", 0),
    "include_stop_str_in_output": ("include_stop_str_in_output", False),
    "skip_special_tokens": ("skip_special_tokens", True),
}


def logit_bias(value) -> dict[int, float] | None:
    """OpenAI sends {"50256": -100}: JSON keys are strings. Each must be a token id."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"'logit_bias' must be an object {{token id: bias}}, got {value!r}", "invalid_type")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}") from None
        out[token] = bias  # SamplingParams checks the bias: a number in [-100, 100]
    return out


def choices_count(body: dict, allow_n: bool) -> int:
    """`n`, and `best_of` only where it equals n (vLLM's v1 engine has no best_of either)."""
    n = body.get("n")
    n = 1 if n is None else n
    if not is_int(n):
        raise invalid("n", f"'n' must be an integer, got {n!r}", "invalid_type")
    if not allow_n and n != 1:
        raise invalid("n", f"'n' must be 1 on this endpoint, got {n}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid(
            "best_of",
            f"'best_of' = {best_of!r} is not supported: this server returns every sample it draws, so best_of "
            f"may only equal n ({n}); ask for n = {best_of!r} and pick yourself",
            "unsupported_parameter",
        )
    return n


def sampling_kwargs(body: dict, *, allow_n: bool = True) -> dict:
    """SamplingParams' keyword arguments from a request body (max_tokens and ignore_eos aside)."""
    kwargs = {}
    for name, (field, default) in FIELDS.items():
        value = body.get(name)
        kwargs[field] = default if value is None else value
    if is_int(kwargs["top_k"]) and kwargs["top_k"] == -1:
        kwargs["top_k"] = 0  # -1 is vLLM's "off", as 0 is ours
    kwargs["logit_bias"] = logit_bias(body.get("logit_bias"))
    kwargs["n"] = choices_count(body, allow_n)
    return kwargs


def build_params(body: dict, max_tokens, ignore_eos, *, allow_n: bool = True) -> SamplingParams:
    """The request's SamplingParams; InvalidParameter (a ValueError) names a bad field."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling_kwargs(body, allow_n=allow_n))
