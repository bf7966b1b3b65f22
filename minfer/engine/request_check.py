"""Whether a request could ever run on this engine: its prompt's ids against the vocabulary, prompt +
max_tokens against the context and the KV cache, n against the sequences run at once. Only fixed
limits are read, so any thread may check (the server does, once, before handing a request to the
engine's thread); a refusal is an InvalidParameter naming the field at fault."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..attention.kv_cache import cdiv
from ..errors import InvalidParameter, is_int
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class CheckedRequest:
    """A request found runnable: add_request takes it as it is, without checking it again."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """An engine's fixed limits, as OnlineScheduler sets them up."""

    vocab_size: int
    max_num_seqs: int
    context_len: int  # the model's, or --max-model-len
    block_size: int
    num_blocks: int


def check_limits(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits) -> CheckedRequest:
    """The request, checked against the limits; else InvalidParameter naming the field at fault."""
    ids, vocab, context = list(prompt_token_ids), limits.vocab_size, limits.context_len
    if not ids:
        raise InvalidParameter("prompt", "the prompt is empty: it must have at least one token")
    bad = next((t for t in ids if not is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        an = "" if is_int(bad) else "an int "  # 1.0, "1", True: not ids
        raise InvalidParameter("prompt", f"prompt token id {bad!r} is not {an}in the vocabulary [0, {vocab})")
    if params.n > limits.max_num_seqs:
        raise InvalidParameter("n", f"n = {params.n} is more completions than this engine runs at once "
                               f"(max_num_seqs {limits.max_num_seqs})")
    for field, ids_given in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids_given or () if t >= vocab), None)  # a stop id out of the vocabulary never stops
        if bad is not None:
            raise InvalidParameter(field, f"{field} token id {bad} is not in the vocabulary [0, {vocab})")
    if params.max_tokens is None:  # vLLM's None: as many as the context and the KV cache leave after the prompt
        room = min(context, limits.num_blocks * limits.block_size)
        if len(ids) >= room:
            raise InvalidParameter("prompt", f"prompt ({len(ids)} tokens) leaves no room for output in the {room} "
                                   f"tokens this engine holds per request", "context_length_exceeded")
        params = replace(params, max_tokens=room - len(ids))
    if len(ids) + params.max_tokens > context:
        raise InvalidParameter("max_tokens" if len(ids) < context else "prompt", f"prompt ({len(ids)} tokens) + "
                               f"max_tokens ({params.max_tokens}) exceeds the model's context of {context} tokens",
                               "context_length_exceeded")
    blocks = cdiv(len(ids) + params.max_tokens, limits.block_size)
    if blocks > limits.num_blocks:
        raise InvalidParameter("max_tokens", f"the request needs {blocks} KV blocks but the cache has only "
                               f"{limits.num_blocks}", "context_length_exceeded")
    return CheckedRequest(ids, params)
